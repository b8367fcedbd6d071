"""The ring itself, forward and backward, on arguments that
flashattn.distributed (__init__.py) has already checked on every rank.

Forward: at step t rank r holds the K/V shard of rank r - t. It posts the
non-blocking receive of the next shard and the send of the current one,
runs the fused engine on every (query segment, key segment) block the band
reaches (``_plan.blocks``), merges each block's (o, lse) into its rows
with fa.merge_states, then waits. Accumulators are float32 whatever the
input dtype.

Backward (FlashAttention-2): with the global o and lse of a query row, one
block's dq, dk, dv are exactly that block's share of the gradients (the
probabilities exp(s - lse) and delta = rowsum(do·o) are global), so no merge
backward is needed: dq is summed on its rank, and each K/V shard travels
with its dK/dV accumulator, which every rank adds its share to and which
comes back to the shard's owner after the last step.
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from .._api import attention, attention_backward
from .._merge import merge_states
from ._comm import raw
from . import _plan as plan

_TAG_KV, _TAG_DKV = 1801, 1802

# MPI moves a large message between processes only while one of them is
# inside an MPI call (MPICH has no progress thread unless asked for one,
# which would spin on a core). So the engine runs on a helper thread, with
# the GIL released, while this thread polls the step's requests this often.
_POLL_SECONDS = 0.0005


class Stats:
    """Seconds spent per kind of work on this rank (for the demo and bench).
    ``dry``: leave the engine calls out, to time the communication alone."""

    def __init__(self, dry: bool = False):
        self.dry = dry
        self.compute = 0.0  # engine calls and merges
        self.wait = 0.0  # blocked in MPI waits: communication not hidden
        self.total = 0.0
        self.blocks = 0  # engine calls
        self.skipped = 0  # (query segment, key segment) pairs the band does not reach
        self.received = 0  # bytes received
        self.hidden = 0  # of which were already in when the compute of their step ended


def _compute(MPI, requests, work, pool, stats) -> None:
    """work() (one step's engine calls) on the pool's thread while this
    thread drives the progress of ``requests``; its exceptions are raised
    here."""
    t = time.perf_counter()
    if not requests or stats.dry:
        work()
    else:
        future = pool.submit(work)
        pending = True
        while pending:
            try:
                future.result(timeout=_POLL_SECONDS)
                break
            except concurrent.futures.TimeoutError:
                pending = not MPI.Request.Testall(requests)
        future.result()
    stats.compute += time.perf_counter() - t


def _wait(MPI, requests, stats, received: int):
    """Waits for a step's messages; counts their bytes as hidden behind the
    step's compute when they were all complete before this wait."""
    if requests:
        stats.received += received
        if MPI.Request.Testall(requests):
            stats.hidden += received
            return
        t = time.perf_counter()
        MPI.Request.Waitall(requests)
        stats.wait += time.perf_counter() - t


class _KVRing:
    """Two byte buffers for K and V packed as (2, B, n, Hkv, D): the shard in
    use and the one arriving. Shards may differ in length (n)."""

    def __init__(self, k, v, kv_len, rank, size):
        B, _, Hkv, D = k.shape
        self.row = (B, Hkv, D)
        self.kv_len = kv_len
        n = max(kv_len) if kv_len else 0
        self.bufs = [np.empty(2 * B * n * Hkv * D, k.dtype) for _ in range(min(size, 2))]
        own = self.view(0, kv_len[rank])
        own[0], own[1] = k, v

    def view(self, which: int, n: int) -> np.ndarray:
        B, Hkv, D = self.row
        return self.bufs[which % len(self.bufs)][: 2 * B * n * Hkv * D].reshape(2, B, n, Hkv, D)

    def incoming(self, step, rank, size) -> int:
        """Bytes of the shard that arrives during ``step``."""
        if step == size - 1:
            return 0
        return self.view(step + 1, self.kv_len[(rank - step - 1) % size]).nbytes

    def exchange(self, comm, step, rank, size):
        """Posts the receive of step + 1's shard and the send of step's shard."""
        if step == size - 1:
            return []
        src, nxt = (rank - step) % size, (rank - step - 1) % size
        return [comm.Irecv(raw(self.view(step + 1, self.kv_len[nxt])), source=(rank - 1) % size,
                           tag=_TAG_KV),
                comm.Isend(raw(self.view(step, self.kv_len[src])), dest=(rank + 1) % size,
                           tag=_TAG_KV)]


def forward(MPI, comm, q, k, v, q_len, kv_len, layout, band, scale, backend, stats):
    rank, size = comm.Get_rank(), comm.Get_size()
    start = time.perf_counter()
    Tq, Tk = sum(q_len), sum(kv_len)
    q_segs = plan.segments(layout, q_len, rank)
    B, Tr, H, _ = q.shape
    ring = _KVRing(k, v, kv_len, rank, size)
    o = np.zeros(q.shape[:3] + v.shape[3:], np.float32)
    lse = np.full((B, H, Tr), -np.inf, np.float32)
    merged = np.zeros(Tr, bool)  # rows that hold some block's result already

    def work(kv, calls):
        for r0, r1, k0, k1, window in calls:
            o_b, lse_b = attention(q[:, r0:r1], kv[0][:, k0:k1], kv[1][:, k0:k1], window=window,
                                   scale=scale, return_lse=True, backend=backend)
            if merged[r0:r1].any():
                o[:, r0:r1], lse[..., r0:r1] = merge_states(
                    [o[:, r0:r1], o_b.astype(np.float32, copy=False)], [lse[..., r0:r1], lse_b])
            else:  # the first keys these rows see: merging with nothing is a copy
                o[:, r0:r1], lse[..., r0:r1] = o_b, lse_b
            merged[r0:r1] = True

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashattn-ring") as pool:
        for step in range(size):
            src = (rank - step) % size
            requests = ring.exchange(comm, step, rank, size)
            kv = ring.view(step, kv_len[src])
            kv_segs = plan.segments(layout, kv_len, src)
            calls = [] if stats.dry else plan.blocks(q_segs, kv_segs, Tq, Tk, band)
            _compute(MPI, requests, lambda: work(kv, calls), pool, stats)
            stats.blocks += len(calls)
            stats.skipped += len(q_segs) * len(kv_segs) - len(calls)
            _wait(MPI, requests, stats, ring.incoming(step, rank, size))
    stats.total += time.perf_counter() - start
    return o.astype(q.dtype, copy=False), lse


def backward(MPI, comm, do, q, k, v, o, lse, q_len, kv_len, layout, band, scale, backend, stats):
    rank, size = comm.Get_rank(), comm.Get_size()
    start = time.perf_counter()
    Tq, Tk = sum(q_len), sum(kv_len)
    q_segs = plan.segments(layout, q_len, rank)
    B, _, Hkv, D = k.shape
    ring = _KVRing(k, v, kv_len, rank, size)
    dq = np.zeros(q.shape, np.float32)
    left, right = (rank - 1) % size, (rank + 1) % size
    sending = []  # (request, buffer) of the dK/dV accumulator sent last step
    arriving = np.empty(2 * B * (max(kv_len) if kv_len else 0) * Hkv * D, np.float32)

    def dkv_view(buf, n):
        return buf[: 2 * B * n * Hkv * D].reshape(2, B, n, Hkv, D)

    def work(kv, dkv, calls):
        for r0, r1, k0, k1, window in calls:
            dq_b, dk_b, dv_b = attention_backward(
                do[:, r0:r1], q[:, r0:r1], kv[0][:, k0:k1], kv[1][:, k0:k1], o[:, r0:r1],
                lse[..., r0:r1], window=window, scale=scale, backend=backend)
            dq[:, r0:r1] += dq_b
            dkv[0][:, k0:k1] += dk_b
            dkv[1][:, k0:k1] += dv_b

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashattn-ring") as pool:
        for step in range(size):
            src = (rank - step) % size
            n = kv_len[src]
            requests = ring.exchange(comm, step, rank, size)
            # The accumulator of shard src, from the rank that held it last
            # step (its owner computed the first share at step 0).
            acc_request = ([comm.Irecv(raw(dkv_view(arriving, n)), source=left, tag=_TAG_DKV)]
                           if step > 0 else [])
            kv = ring.view(step, n)
            dkv = np.zeros((2, B, n, Hkv, D), np.float32)
            kv_segs = plan.segments(layout, kv_len, src)
            calls = [] if stats.dry else plan.blocks(q_segs, kv_segs, Tq, Tk, band)
            in_flight = acc_request + requests + [r for r, _ in sending]
            _compute(MPI, in_flight, lambda: work(kv, dkv, calls), pool, stats)
            stats.blocks += len(calls)
            stats.skipped += len(q_segs) * len(kv_segs) - len(calls)
            _wait(MPI, in_flight, stats,
                  ring.incoming(step, rank, size) + (dkv.nbytes if step > 0 else 0))
            if step > 0:
                dkv += dkv_view(arriving, n)
            if size > 1:
                sending = [(comm.Isend(raw(dkv), dest=right, tag=_TAG_DKV), dkv)]
            else:
                mine = dkv
    if size > 1:
        # The last holder of this rank's shard sends the finished accumulator
        # home, into the buffer that is free now.
        mine = dkv_view(arriving, kv_len[rank])
        done = [comm.Irecv(raw(mine), source=left, tag=_TAG_DKV)]
        _wait(MPI, done + [r for r, _ in sending], stats, mine.nbytes)
    stats.total += time.perf_counter() - start
    return (dq.astype(q.dtype, copy=False), mine[0].astype(k.dtype, copy=False),
            mine[1].astype(v.dtype, copy=False))
