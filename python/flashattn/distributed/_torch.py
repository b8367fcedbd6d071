"""flashattn.torch.ring_attention: ring attention over MPI
(flashattn.distributed) as a differentiable torch function. The forward
saves this rank's o and lse; the backward is ring_attention_backward, so
``loss.backward()`` must run on every rank of the communicator (it is a
collective, as the forward is)."""

from __future__ import annotations

import torch

from .. import distributed as fd


def _host(x: torch.Tensor):
    """x as a NumPy array on the CPU: a view of a contiguous CPU tensor, else
    one copy."""
    return x.detach().cpu().contiguous().numpy()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, options):
        o, lse = fd.ring_attention(_host(q), _host(k), _host(v), **options)
        o_t, lse_t = torch.from_numpy(o), torch.from_numpy(lse)
        ctx.save_for_backward(q, k, v, o_t, lse_t)
        ctx.options = options
        ctx.mark_non_differentiable(lse_t)
        return o_t.to(q.device), lse_t.to(q.device)

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        grads = fd.ring_attention_backward(_host(do), _host(q), _host(k), _host(v), o.numpy(),
                                           lse.numpy(), **ctx.options)
        return (*(torch.from_numpy(g).to(q.device) for g in grads), None)


def ring_attention(q, k, v, *, comm=None, causal=False, window=(-1, -1), scale=None,
                   layout="contiguous", backend=None, return_lse=False):
    """flashattn.distributed.ring_attention on torch tensors, differentiable.

    q (B, T_r, H, D), k and v (B, T_r, Hkv, D): this rank's shards, as in
    flashattn.distributed (``layout`` is the sharding, "contiguous" or
    "zigzag"). Returns this rank's o, or (o, lse) with ``return_lse=True``;
    lse is not differentiable. float32; tensors on another device than the
    CPU are copied to it and the results back.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"flashattn.torch.ring_attention: {name} must be a torch.Tensor, "
                            f"got {type(x).__name__}")
    options = dict(comm=comm, causal=causal, window=window, scale=scale, layout=layout,
                   backend=backend)
    o, lse = _RingAttention.apply(q, k, v, options)
    return (o, lse) if return_lse else o
