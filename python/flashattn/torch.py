"""flashattn for PyTorch: differentiable attention with the fused backward.

    import flashattn.torch as fat
    o = fat.attention(q, k, v, causal=True)                 # (B, T, H, D)
    o = fat.attention(q, k, v, causal=True, layout="bhtd")  # torch's (B, H, T, D)

``attention`` calls the custom op ``torch.ops.flashattn.attention``
(registered with ``torch.library``), whose autograd formula saves o and the
log-sum-exp and calls ``torch.ops.flashattn.attention_backward``, the fused
backward. Both ops have fake implementations, so ``torch.compile`` traces
through them without a graph break.

Devices and copies:

- CPU tensors are read in place through DLPack (any strides whose last axis
  is contiguous; ``layout="bhtd"`` is a transposed view, not a copy); outputs
  are the engine's buffers, wrapped by ``torch.from_numpy``; the GIL is
  released while the engine runs.
- MPS tensors (Mac), where torch has ``torch.mps.compile_shader`` (2.7 and
  later) and ``backend=None``: in torch's own MPS stream (flashattn._instream,
  docs/metal.md): the metal engine's kernels, compiled by torch from the
  shipped shaders, run on the tensors where they are, outputs allocated by
  torch; nothing is copied to the host and nothing waits.
- MPS tensors otherwise (an older torch, or ``backend=`` naming an engine):
  torch does not expose MPS storage to other libraries as host memory, so
  each input is copied to the CPU once and each output back to the MPS
  device once (O(B·T·H·D) per call, never O(T²)); the engine computes.
- float32 runs on the engines. float64 runs on ``flashattn.reference``
  (NumPy, float64): slow and exact, for ``torch.autograd.gradcheck``.
"""

from typing import Optional, Tuple

import torch

from . import reference
from ._api import attention as _np_attention
from ._args import scale as _scale, window as _window
from ._api import attention_backward as _np_attention_backward
from ._api import backends as _backends
from .distributed._torch import ring_attention  # issue 18: over MPI, flashattn.distributed
from ._instream import torch_stream as _instream

__all__ = ["attention", "ring_attention"]

_LAYOUTS = ("bthd", "bhtd")
_ENGINES = tuple(_backends())  # read once: torch.compile cannot trace into the extension


def _host(x: torch.Tensor) -> torch.Tensor:
    """x as a CPU tensor for the NumPy API: itself on the CPU, else one copy."""
    x = x.detach()
    return x if x.device.type == "cpu" else x.cpu()


def _to(device: torch.device, *arrays) -> Tuple[torch.Tensor, ...]:
    out = tuple(torch.from_numpy(a) for a in arrays)
    return out if device.type == "cpu" else tuple(t.to(device) for t in out)


@torch.library.custom_op("flashattn::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  window_left: int, window_right: int, scale: Optional[float],
                  backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    host = _instream.host(q.device) if backend is None and q.dtype != torch.float64 else None
    if host is not None:  # in torch's MPS stream (flashattn._instream)
        return _instream.forward(host, q, k, v, causal=causal, window=window, scale=scale)
    hq, hk, hv = _host(q), _host(k), _host(v)
    if q.dtype == torch.float64:
        o, lse = reference.attention(hq.numpy(), hk.numpy(), hv.numpy(), causal=causal,
                                     window=window, scale=scale, return_lse=True)
        lse = lse.astype("float32")
    else:
        o, lse = _np_attention(hq, hk, hv, causal=causal, window=window, scale=scale,
                               return_lse=True, backend=backend)
    return _to(q.device, o, lse)


@_attention_op.register_fake
def _attention_fake(q, k, v, causal, window_left, window_right, scale, backend):
    B, Tq, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, Tq), dtype=torch.float32)


@torch.library.custom_op("flashattn::attention_backward", mutates_args=())
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           o: torch.Tensor, lse: torch.Tensor, causal: bool, window_left: int,
                           window_right: int, scale: Optional[float],
                           backend: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    window = (window_left, window_right)
    host = _instream.host(q.device) if backend is None and q.dtype != torch.float64 else None
    if host is not None:
        return _instream.backward(host, do, q, k, v, o, lse, causal=causal, window=window,
                                  scale=scale)
    args = [_host(x) for x in (do, q, k, v, o, lse)]
    if q.dtype == torch.float64:
        grads = reference.attention_backward(*(a.numpy() for a in args), causal=causal,
                                             window=window, scale=scale)
    else:
        grads = _np_attention_backward(*args, causal=causal, window=window, scale=scale,
                                       backend=backend)
    return _to(q.device, *grads)


@_attention_backward_op.register_fake
def _attention_backward_fake(do, q, k, v, o, lse, causal, window_left, window_right, scale,
                             backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashattn.attention_backward(do, q, k, v, o, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, *, causal=False, window=(-1, -1), scale=None, layout="bthd",
              backend=None):
    """Exact softmax attention, fused, differentiable through the fused backward.

    Same contract as ``flashattn.attention``, on torch tensors:
    ``layout="bthd"`` (default): q (B, Tq, H, D), k and v (B, Tk, Hkv, D);
    ``layout="bhtd"``: torch's (B, H, Tq, D) and (B, Hkv, Tk, D), read as
    transposed views without a copy. Returns o in the layout of q.
    float32 on the engines (``backend`` picks one); float64 on the reference.
    """
    fn = "flashattn.torch.attention"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{fn}: {name} must be float32 (float64 runs on the reference), "
                            f"got {x.dtype}; convert with {name}.float()")
        if x.dim() != 4:
            raise ValueError(f"{fn}: {name} must have 4 dimensions, got shape "
                             f"{tuple(x.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{fn}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if layout not in _LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {_LAYOUTS}, got {layout!r}")
    if backend is not None and backend not in _ENGINES:
        raise ValueError(f"{fn}: unknown backend {backend!r}; available here: "
                         f"{list(_ENGINES)}")
    if backend is not None and q.dtype == torch.float64:
        raise TypeError(f"{fn}: the engines run float32; float64 runs on the reference only "
                        f"(backend=None)")
    left, right = _window(fn, window)
    scale = _scale(fn, scale)
    if layout == "bhtd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    o, _ = torch.ops.flashattn.attention(q, k, v, bool(causal), left, right, scale, backend)
    return o.transpose(1, 2) if layout == "bhtd" else o
