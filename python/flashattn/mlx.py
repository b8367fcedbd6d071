"""flashattn for MLX: differentiable attention with the fused backward.

    import flashattn.mlx as fam
    o = fam.attention(q, k, v, causal=True)   # q (B, Tq, H, D); k, v (B, Tk, Hkv, D)

``attention`` is an ``mx.custom_function`` whose forward returns o and the
log-sum-exp and whose vjp calls the fused backward, so ``mx.grad`` and
``mx.value_and_grad`` work through it. The metal engine computes on a Mac
(the default there), the cpu engine elsewhere; ``backend=`` picks one.

Copies, every one of them:

- inputs (q, k, v, and in the vjp the cotangent and the saved o and lse)
  are read in place: an MLX array in host or unified memory is viewed by
  NumPy through DLPack or the buffer protocol (evaluating it first, as any
  read does). On a Mac the metal engine then copies each input that is not
  one of its pool buffers once into one (docs/metal.md), O(B·T·H·D);
- outputs (o, lse, dq, dk, dv) are copied once each into new MLX arrays:
  ``mx.array`` cannot wrap memory it did not allocate.

Nothing of size T² is made. Being a Python-level function, it is not for
``mx.compile`` (which cannot trace into the engine).
"""

from __future__ import annotations

import mlx.core as mx

from ._args import scale as _scale, window as _window
from ._api import attention as _np_attention
from ._api import attention_backward as _np_attention_backward

__all__ = ["attention"]


def _make(causal: bool, window: tuple[int, int], scale, backend):
    options = dict(causal=causal, window=window, scale=scale, backend=backend)

    @mx.custom_function
    def attend(q, k, v):
        o, lse = _np_attention(q, k, v, return_lse=True, **options)
        return mx.array(o), mx.array(lse)

    @attend.vjp
    def attend_vjp(primals, cotangents, outputs):
        q, k, v = primals
        do = cotangents[0]  # the lse cotangent is dropped: lse is not returned to users
        o, lse = outputs
        grads = _np_attention_backward(do, q, k, v, o, lse, **options)
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
