"""Context parallelism across processes and machines: exact ring attention
over MPI (mpi4py), forward and backward.

Each rank holds its shard of the sequence: q, k, v (and do) shaped
(B, T_r, H, D) and (B, T_r, Hkv, D). The K/V shards travel around the ring
of ranks with non-blocking sends and receives while each rank runs the fused
engine on the shard it holds; partial results are merged with
fa.merge_states, and the backward sends each shard's dK/dV accumulator along
with it. ``gather`` of the results equals fa.attention /
fa.attention_backward on the gathered inputs.

    mpiexec -n 4 python -m flashattn.distributed demo

mpi4py is imported when a function here runs (pip install 'flashattn[mpi]');
importing this module needs nothing beyond flashattn.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import numpy as np

from .. import _args
from . import _ring
from . import _plan as plan
from .._api import attention, attention_backward
from ._comm import communicator
from . import _comm

__all__ = ["ring_attention", "ring_attention_backward", "shard", "gather"]


def shard(x: np.ndarray, comm: Any = None, layout: str = "contiguous",
          axis: int = 1) -> np.ndarray:
    """This rank's part of the full array ``x`` (the same on every rank), a
    copy: ``layout="contiguous"``, the rank-th of numpy.array_split's P parts
    along ``axis``; ``"zigzag"``, parts r and 2P - 1 - r of 2P, concatenated.
    lse (B, H, T) has its sequence on axis 2."""
    _, comm = communicator("shard", comm)
    return _comm.shard("shard", comm, x, layout, axis)


def gather(x_local: np.ndarray, comm: Any = None, layout: str = "contiguous",
           axis: int = 1) -> np.ndarray:
    """The full array on every rank, from each rank's part along ``axis``
    (contiguous parts may be of any lengths; zigzag ones as ``shard`` makes
    them). Collective: every rank calls it."""
    MPI, comm, failure = _comm.collective_communicator("gather", comm)
    return _comm.gather("gather", MPI, comm, x_local, layout, axis, failure)


def _local_checks(fn, arrays, causal, window, scale, layout, backend):
    """The checks one rank can make alone, the engines' own included (on
    empty slices, so that every dtype and backend they accept passes): the
    normalised options and the metadata all ranks must agree on."""
    plan.check_layout(fn, layout)
    causal = _args.flag(fn, "causal", causal)
    window = _args.window(fn, window)
    scale = _args.scale(fn, scale)
    for name, x in arrays.items():
        _args.array(fn, name, x)
        if x.ndim != (3 if name == "lse" else 4):
            want = "(B, H, T_r)" if name == "lse" else "(B, T_r, heads, D)"
            raise ValueError(f"{fn}: {name} must be {want}, this rank's shard; got shape {x.shape}")
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"{fn}: k and v must hold the same keys, got shapes {k.shape} and "
                         f"{v.shape}")
    empty = dict(causal=causal, window=window, scale=scale, backend=backend)
    if "do" in arrays:
        do, o, lse = arrays["do"], arrays["o"], arrays["lse"]
        for name, x in (("do", do), ("o", o)):
            if x.shape != q.shape:
                raise ValueError(f"{fn}: {name} must have the shape of q {q.shape}, got {x.shape}")
        want = (q.shape[0], q.shape[2], q.shape[1])
        if lse.shape != want:
            raise ValueError(f"{fn}: lse must be (B, H, T_r) = {want}, got {lse.shape}")
        attention_backward(do[:, :0], q[:, :0], k[:, :0], v[:, :0], o[:, :0], lse[..., :0], **empty)
    else:
        attention(q[:, :0], k[:, :0], v[:, :0], **empty)
    meta = {"B, H, D of q": (q.shape[0], q.shape[2], q.shape[3]),
            "Hkv, D of k": (k.shape[2], k.shape[3]),
            "dtypes": tuple(x.dtype.str for x in arrays.values()),
            "causal": causal, "window": window, "scale": scale, "layout": layout,
            "backend": backend}
    return causal, window, scale, meta, (q.shape[1], k.shape[1])


def _agree(fn, comm, arrays, causal, window, scale, layout, backend, failure=None):
    """Checks on every rank at once (one allgather), so that a bad argument
    on any rank (or its ``failure``, found before: a bad comm, a tensor that
    did not convert) raises the same error on all of them instead of leaving
    the others waiting: returns the options and every rank's q and kv
    lengths."""
    everyone = _comm.agree(fn, comm, lambda: _local_checks(fn, arrays, causal, window, scale,
                                                           layout, backend), failure)
    meta0 = everyone[0][3]
    causal, window, scale = everyone[comm.Get_rank()][:3]
    for r, (_, _, _, meta, _) in enumerate(everyone):
        for key, value in meta.items():
            if value != meta0[key]:
                raise ValueError(f"{fn}: the ranks disagree on {key}: rank 0 has "
                                 f"{meta0[key]!r}, rank {r} has {value!r}; only the "
                                 "sequence length may differ between shards")
    q_len = [int(mine[4][0]) for mine in everyone]
    kv_len = [int(mine[4][1]) for mine in everyone]
    plan.check_lengths(fn, "q", layout, q_len)
    plan.check_lengths(fn, "k", layout, kv_len)
    return causal, window, scale, q_len, kv_len


def _abort_on_error(fn, comm, run):
    """Runs the ring. A rank that fails inside it cannot tell the others,
    which would wait for its messages forever: it says what failed on stderr
    and aborts the communicator (MPI_Abort), which ends every rank. Alone
    (one rank), it raises as usual."""
    try:
        return run()
    except BaseException as e:  # KeyboardInterrupt too: the others would hang all the same
        rank, size = comm.Get_rank(), comm.Get_size()
        if size == 1:
            raise
        sys.stderr.write(
            f"flashattn.distributed.{fn}: rank {rank} of {size} failed inside the ring: "
            f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            f"flashattn.distributed.{fn}: aborting the communicator (MPI_Abort, error code 1) "
            "so that the other ranks do not wait forever\n")
        sys.stderr.flush()
        comm.Abort(1)
        raise  # not reached: Abort ends this process too


def _run(fn, comm, body):
    """body(ring_comm) on a duplicate of comm, so the ring's messages never
    meet the caller's."""
    ring = comm.Dup()
    try:
        return _abort_on_error(fn, comm, lambda: body(ring))
    finally:
        ring.Free()


def ring_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, comm: Any = None,
                   causal: bool = False, window: tuple[int, int] = (-1, -1),
                   scale: float | None = None, layout: str = "contiguous",
                   backend: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention over the sequence split across the ranks of ``comm``.

    Args:
        q: (B, T_r, H, D), this rank's query shard; k, v: (B, T'_r, Hkv, D),
            its key/value shard. Every rank passes the same B, heads, D,
            dtype and options; only the shard lengths may differ.
        comm: an mpi4py communicator; default MPI.COMM_WORLD.
        causal, window, scale: as fa.attention, over the global sequence
            (query i of Tq sits at key position i + Tk - Tq).
        layout: ``"contiguous"`` (rank r holds the r-th run of rows, of any
            length) or ``"zigzag"`` (chunks r and 2P - 1 - r of 2P, as
            ``shard`` makes them: balances causal work).
        backend: the engine each rank runs, as fa.attention.

    Returns:
        (o, lse): this rank's shards of the global o (B, T_r, H, D) and lse
        (B, H, T_r) float32.
    """
    return _forward(q, k, v, comm, causal, window, scale, layout, backend, _ring.Stats())


def _forward(q, k, v, comm, causal, window, scale, layout, backend, stats, failure=None):
    """ring_attention, adding this rank's times to ``stats`` (_ring.Stats);
    ``failure``: an error the caller found in this rank's arguments (raised
    on every rank by the agreement)."""
    fn = "ring_attention"
    MPI, comm, bad_comm = _comm.collective_communicator(fn, comm)
    arrays = {"q": q, "k": k, "v": v}
    causal, window, scale, q_len, kv_len = _agree(fn, comm, arrays, causal, window, scale,
                                                  layout, backend, failure or bad_comm)
    band = plan.global_band(sum(q_len), sum(kv_len), causal, window)
    return _run(fn, comm, lambda ring: _ring.forward(
        MPI, ring, q, k, v, q_len, kv_len, layout, band, scale, backend, stats))


def ring_attention_backward(do: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                            o: np.ndarray, lse: np.ndarray, *, comm: Any = None,
                            causal: bool = False, window: tuple[int, int] = (-1, -1),
                            scale: float | None = None, layout: str = "contiguous",
                            backend: str | None = None
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ring_attention for this rank's shard ``do`` of the
    output gradient; o and lse are this rank's outputs of ring_attention with
    the same options. Returns this rank's shards of dq, dk, dv."""
    return _backward(do, q, k, v, o, lse, comm, causal, window, scale, layout, backend,
                     _ring.Stats())


def _backward(do, q, k, v, o, lse, comm, causal, window, scale, layout, backend, stats,
              failure=None):
    """ring_attention_backward, adding this rank's times to ``stats``;
    ``failure`` as in _forward."""
    fn = "ring_attention_backward"
    MPI, comm, bad_comm = _comm.collective_communicator(fn, comm)
    arrays = {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}
    causal, window, scale, q_len, kv_len = _agree(fn, comm, arrays, causal, window, scale,
                                                  layout, backend, failure or bad_comm)
    band = plan.global_band(sum(q_len), sum(kv_len), causal, window)
    return _run(fn, comm, lambda ring: _ring.backward(
        MPI, ring, do, q, k, v, o, lse, q_len, kv_len, layout, band, scale, backend, stats))

