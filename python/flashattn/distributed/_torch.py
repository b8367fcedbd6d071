"""flashattn.torch.ring_attention: ring attention over MPI
(flashattn.distributed) as a differentiable torch function. The forward
saves this rank's o and lse; the backward is ring_attention_backward, so
``loss.backward()`` must run on every rank of the communicator (it is a
collective, as the forward is)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from .. import distributed as fd
from . import _ring


_FN = "flashattn.torch.ring_attention"


def _host(x: torch.Tensor) -> np.ndarray:
    """x as a NumPy array on the CPU: a view of a contiguous CPU tensor, else
    one copy; bfloat16 as ml_dtypes.bfloat16 (torch reads its bits)."""
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A NumPy result as a tensor (no copy on the CPU), bfloat16 included."""
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t.to(device)


def _hosts(tensors: dict):
    """(arrays, failure): each tensor as NumPy, or the error that one of them
    gave. The error is not raised here: the ring's agreement raises it on
    every rank, where raising it on this rank alone would leave the others
    waiting for this one forever."""
    try:
        for name, x in tensors.items():
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{_FN}: {name} must be a torch.Tensor, got "
                                f"{type(x).__name__}")
        return {name: _host(x) for name, x in tensors.items()}, None
    except Exception as e:  # noqa: BLE001  raised on every rank by the agreement
        return None, e


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, options):
        arrays, failure = _hosts({"q": q, "k": k, "v": v})
        if failure is not None:
            arrays = dict.fromkeys(("q", "k", "v"))
        o, lse = fd._forward(arrays["q"], arrays["k"], arrays["v"], options["comm"],
                             options["causal"], options["window"], options["scale"],
                             options["layout"], options["backend"], _ring.Stats(), failure)
        o_t, lse_t = _tensor(o, torch.device("cpu")), torch.from_numpy(lse)
        ctx.save_for_backward(q, k, v, o_t, lse_t)
        ctx.options = options
        ctx.mark_non_differentiable(lse_t)
        return o_t.to(q.device), lse_t.to(q.device)

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        grads = fd.ring_attention_backward(_host(do), _host(q), _host(k), _host(v), _host(o),
                                           lse.numpy(), **ctx.options)
        return (*(_tensor(g, q.device) for g in grads), None)


def ring_attention(q, k, v, *, comm=None, causal=False, window=(-1, -1), scale=None,
                   layout="contiguous", backend=None, return_lse=False):
    """flashattn.distributed.ring_attention on torch tensors, differentiable.

    q (B, T_r, H, D), k and v (B, T_r, Hkv, D): this rank's shards, as in
    flashattn.distributed (``layout`` is the sharding, "contiguous" or
    "zigzag"). Returns this rank's o, or (o, lse) with ``return_lse=True``;
    lse is not differentiable. float32, float16 or bfloat16; tensors on
    another device than the CPU are copied to it and the results back. A
    bad argument on one rank (a NumPy array, another dtype) raises the same
    error on every rank.
    """
    options = dict(comm=comm, causal=causal, window=window, scale=scale, layout=layout,
                   backend=backend)
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        # Not through autograd (it wants tensors): the agreement raises on every rank.
        arrays, failure = _hosts({"q": q, "k": k, "v": v})
        fd._forward(None, None, None, comm, causal, window, scale, layout, backend,
                    _ring.Stats(), failure)
        raise AssertionError("unreachable: the agreement raised the failure")
    o, lse = _RingAttention.apply(q, k, v, options)
    return (o, lse) if return_lse else o
