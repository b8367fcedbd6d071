"""flashattn for MLX: differentiable attention with the fused backward.

    import flashattn.mlx as fam
    o = fam.attention(q, k, v, causal=True)   # q (B, Tq, H, D); k, v (B, Tk, Hkv, D)

``attention`` is an ``mx.custom_function`` whose forward returns o and the
log-sum-exp and whose vjp calls the fused backward, so ``mx.grad`` and
``mx.value_and_grad`` work through it.

On a Mac whose MLX computes on the GPU (the default there), both run in
MLX's own stream (``backend=None``; flashattn._instream, docs/metal.md): the
kernels of the metal engine, compiled by ``mx.fast.metal_kernel`` from the
shipped shaders, dispatched lazily on MLX's arrays, outputs allocated by
MLX; nothing is copied to the host and nothing waits. That path works
under ``mx.compile`` too.

Elsewhere, or with ``backend=`` naming an engine, the host-copy path:

- inputs (q, k, v, and in the vjp the cotangent and the saved o and lse)
  are read in place: an MLX array in host or unified memory is viewed by
  NumPy through DLPack or the buffer protocol (evaluating it first, as any
  read does). On a Mac the metal engine then copies each input that is not
  one of its pool buffers once into one (docs/metal.md), O(B·T·H·D);
- outputs (o, lse, dq, dk, dv) are copied once each into new MLX arrays:
  ``mx.array`` cannot wrap memory it did not allocate.

Nothing of size T² is made. The host-copy path reads arrays on the CPU, so
it cannot run inside ``mx.compile``: it raises a RuntimeError saying so.
"""

from __future__ import annotations

import mlx.core as mx

from ._args import scale as _scale, window as _window
from ._api import attention as _np_attention
from ._api import attention_backward as _np_attention_backward
from ._instream import mlx_stream as _instream

__all__ = ["attention"]


def _host_copy(fn: str, compute):
    """compute() on the host-copy path; inside mx.compile, where MLX will not
    hand arrays to the CPU, a RuntimeError that says why."""
    try:
        return compute()
    except RuntimeError as e:
        if "function transformations" not in str(e):
            raise
        raise RuntimeError(
            f"{fn}: cannot run inside mx.compile (or mx.vmap) on the host-copy path, which "
            "reads the arrays on the CPU; flashattn runs in MLX's stream, and so under "
            "mx.compile, only on a Mac with MLX's GPU and backend=None (here: "
            "call it outside the compiled function)") from e


def _make(causal: bool, window: tuple[int, int], scale, backend):
    options = dict(causal=causal, window=window, scale=scale)
    fn = "flashattn.mlx.attention"

    @mx.custom_function
    def attend(q, k, v):
        host = _instream.host() if backend is None else None
        if host is not None:  # in MLX's stream (flashattn._instream)
            return _instream.forward(host, q, k, v, **options)
        o, lse = _host_copy(fn, lambda: _np_attention(q, k, v, return_lse=True,
                                                      backend=backend, **options))
        return mx.array(o), mx.array(lse)

    @attend.vjp
    def attend_vjp(primals, cotangents, outputs):
        q, k, v = primals
        do = cotangents[0]  # the lse cotangent is dropped: lse is not returned to users
        o, lse = outputs
        host = _instream.host() if backend is None else None
        if host is not None:
            return _instream.backward(host, do, q, k, v, o, lse, **options)
        grads = _host_copy(fn, lambda: _np_attention_backward(do, q, k, v, o, lse,
                                                              backend=backend, **options))
        return tuple(mx.array(g) for g in grads)

    return attend


_FUNCTIONS: dict = {}


def attention(q, k, v, *, causal=False, window=(-1, -1), scale=None, backend=None):
    """Exact softmax attention, fused, differentiable through the fused backward.

    Same contract as ``flashattn.attention`` on float32 MLX arrays: q
    (B, Tq, H, D), k and v (B, Tk, Hkv, D); returns o shaped like q.
    """
    fn = "flashattn.mlx.attention"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, mx.array):
            raise TypeError(f"{fn}: {name} must be an mlx.core.array, got {type(x).__name__}")
        if x.dtype != mx.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {x.dtype}; convert with "
                            f"{name}.astype(mx.float32)")
    key = (bool(causal), _window(fn, window), _scale(fn, scale), backend)
    if key not in _FUNCTIONS:
        _FUNCTIONS[key] = _make(*key)
    return _FUNCTIONS[key](q, k, v)[0]
