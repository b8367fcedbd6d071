"""One rank of the ring attention tests (test_distributed.py beside it
starts it with mpiexec -n P): runs every case of CASES forward and backward
through flashattn.distributed, gathers the shards, and on rank 0 checks them
against the float64 reference by FlashAttention's rule (helpers.py) and
against the single-process fa.attention / fa.attention_backward; writes one
JSON record per case to the file named on the command line.

    mpiexec -n 3 python ring_worker.py OUT.json          # the cases
    mpiexec -n 3 python ring_worker.py --fail-rank 1     # rank 1 raises mid-ring
    mpiexec -n 2 python ring_worker.py --bad-args        # each rank reports the error
    mpiexec -n 2 python ring_worker.py --bad-args-collective  # comm, gather, torch (issue 32)
"""

from __future__ import annotations

import dataclasses
import json
import sys

import ml_dtypes
import numpy as np

import flashattn as fa
import helpers
from flashattn import distributed as fd


@dataclasses.dataclass(frozen=True)
class RingCase:
    name: str
    layout: str
    Tq: int
    Tk: int
    H: int
    Hkv: int
    D: int
    causal: bool = False
    window: tuple = (-1, -1)
    uneven: bool = False  # contiguous shards of unequal lengths, one empty when P >= 3
    scale: float | None = None
    backend: str | None = None


CASES = [
    RingCase("contiguous-full-mha", "contiguous", 48, 48, 4, 4, 32),
    RingCase("contiguous-causal-gqa", "contiguous", 53, 53, 6, 2, 40, causal=True),
    RingCase("contiguous-uneven-causal-mqa", "contiguous", 0, 0, 4, 1, 24, causal=True,
             uneven=True),
    RingCase("contiguous-uneven-full-gqa", "contiguous", 0, 0, 4, 2, 16, uneven=True),
    RingCase("zigzag-causal-gqa", "zigzag", 61, 61, 6, 2, 32, causal=True),
    RingCase("zigzag-full-mha", "zigzag", 40, 40, 2, 2, 32),
    RingCase("contiguous-causal-window-5_0", "contiguous", 57, 57, 4, 2, 32, causal=True,
             window=(5, 0)),
    RingCase("zigzag-window-7_3", "zigzag", 50, 50, 4, 2, 32, window=(7, 3)),
    RingCase("contiguous-uneven-window--1_4", "contiguous", 0, 0, 4, 4, 16, window=(-1, 4),
             uneven=True),
    RingCase("zigzag-window-6_-1", "zigzag", 45, 45, 4, 1, 16, window=(6, -1)),
    RingCase("contiguous-uneven-cross-causal", "contiguous", 0, 0, 4, 2, 32, causal=True,
             uneven=True),
    RingCase("zigzag-cross-causal-window-9_0", "zigzag", 35, 52, 4, 2, 32, causal=True,
             window=(9, 0)),
    RingCase("contiguous-causal-scale", "contiguous", 44, 44, 4, 2, 32, causal=True, scale=0.3),
    RingCase("zigzag-causal-gqa-metal-sim", "zigzag", 24, 24, 4, 2, 16, causal=True,
             backend="metal-sim"),
]


def uneven_lengths(size: int, cross: bool) -> tuple[list[int], list[int]]:
    """Unequal contiguous shard lengths; rank 1 holds nothing when P >= 3."""
    q = [5 + (7 * r) % 13 for r in range(size)]
    kv = [9 + (5 * r) % 11 for r in range(size)] if cross else list(q)
    if size >= 3:
        q[1] = 0
        kv[1] = 0 if not cross else kv[1]
    return q, kv


def _local(x, lengths, rank):
    start = sum(lengths[:rank])
    return np.ascontiguousarray(x[:, start:start + lengths[rank]])


def run_case(case: RingCase, comm) -> dict | None:
    rank, size = comm.Get_rank(), comm.Get_size()
    if case.uneven:
        q_len, kv_len = uneven_lengths(size, cross="cross" in case.name)
        Tq, Tk = sum(q_len), sum(kv_len)
    else:
        Tq, Tk = case.Tq, case.Tk
    cfg = helpers.Case(2, Tq, Tk, case.H, case.Hkv, case.D, case.causal, case.window)
    q, k, v, do = helpers.inputs(cfg, seed=len(case.name))  # the same on every rank
    if case.uneven:
        ql, kl, vl, dol = (_local(x, n, rank) for x, n in ((q, q_len), (k, kv_len), (v, kv_len),
                                                           (do, q_len)))
    else:
        ql, kl, vl, dol = (fd.shard(x, layout=case.layout) for x in (q, k, v, do))
    opts = dict(causal=case.causal, window=case.window, scale=case.scale)
    ring_opts = dict(opts, layout=case.layout, backend=case.backend)

    o_l, lse_l = fd.ring_attention(ql, kl, vl, **ring_opts)
    grads_l = fd.ring_attention_backward(dol, ql, kl, vl, o_l, lse_l, **ring_opts)
    shapes_ok = (o_l.shape == ql.shape and lse_l.shape == (2, case.H, ql.shape[1])
                 and [g.shape for g in grads_l] == [ql.shape, kl.shape, vl.shape])
    o = fd.gather(o_l, layout=case.layout)
    lse = fd.gather(lse_l, layout=case.layout, axis=2)
    if not case.uneven:  # shard along lse's sequence axis gives this rank's part back
        shapes_ok = shapes_ok and np.array_equal(fd.shard(lse, layout=case.layout, axis=2), lse_l)
    grads = [fd.gather(g, layout=case.layout) for g in grads_l]
    if rank != 0:
        return None

    record = {"case": case.name, "P": size, "Tq": Tq, "Tk": Tk, "ok": True, "errors": [],
              "ratio": {}, "diff_vs_single": {}}
    if not shapes_ok:
        record["ok"] = False
        record["errors"].append("local result shapes differ from the shards', or "
                                "fd.shard(gathered lse, axis=2) is not the local lse")
    single_o, single_lse = fa.attention(q, k, v, return_lse=True, backend=case.backend, **opts)
    single_grads = fa.attention_backward(do, q, k, v, single_o, single_lse,
                                         backend=case.backend, **opts)
    o64, lse64 = fa.reference.attention(q, k, v, return_lse=True, **opts)
    o32, lse32 = fa.reference.attention(q, k, v, return_lse=True, dtype=np.float32, **opts)
    refs = fa.reference.attention_backward(do, q, k, v, **opts)
    bases = fa.reference.attention_backward(do, q, k, v, dtype=np.float32, **opts)
    magnitude = max(float(np.max(np.abs(r))) for r in refs)
    checks = [("o", o, o64, o32, helpers.FORWARD_FACTOR, None, single_o),
              ("lse", lse, lse64, lse32, helpers.FORWARD_FACTOR, None, single_lse)]
    checks += [(name, got, ref, base, helpers.GRADIENT_FACTOR, magnitude, single)
               for name, got, ref, base, single in zip(("dq", "dk", "dv"), grads, refs, bases,
                                                       single_grads)]
    backend = case.backend or fa.backends()[0]
    for name, got, ref, base, factor, mag, single in checks:
        helpers.WORST.clear()
        try:
            helpers.assert_close_to_reference(got, ref, base, factor=factor, backend=backend,
                                              name=name, magnitude=mag)
        except AssertionError as e:
            record["ok"] = False
            record["errors"].append(str(e))
        record["ratio"][name] = max(helpers.WORST.values(), default=float("nan"))
        finite = np.isfinite(single)
        same_inf = bool(np.array_equal(np.isneginf(got), np.isneginf(single)))
        record["diff_vs_single"][name] = float(np.max(np.abs(got[finite] - single[finite]),
                                                      initial=0.0))
        if not same_inf:
            record["ok"] = False
            record["errors"].append(f"{name}: -inf where the single process has none, or not "
                                    "where it has")
    return record


def fail_mid_ring(comm, fail_rank: int) -> None:
    """Rank ``fail_rank`` raises at its first engine call (step 0), so it
    never forwards the next shard and rank fail_rank + 1 would wait for it
    forever: ring_attention must abort them all."""
    import flashattn.distributed._ring as ring

    if comm.Get_rank() == fail_rank:
        real, calls = ring.attention, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected failure for the abort test")
            return real(*args, **kwargs)

        ring.attention = failing
    q, k, v, _ = helpers.inputs(helpers.Case(1, 64, 64, 2, 2, 16), seed=1)
    ql, kl, vl = (fd.shard(x) for x in (q, k, v))
    fd.ring_attention(ql, kl, vl)
    print(f"rank {comm.Get_rank()}: finished, which it must not", flush=True)


def bad_args(comm) -> None:
    """Rank 1 passes a wrong argument; every rank must raise, naming rank 1.
    Rank 0 prints every rank's lines (gathered, so they do not interleave)."""
    rank = comm.Get_rank()
    q, k, v, _ = helpers.inputs(helpers.Case(1, 16, 16, 2, 2, 8), seed=2)
    ql, kl, vl = (fd.shard(x) for x in (q, k, v))
    bad = rank == 1
    calls = [("dtype", (ql, kl.astype(np.float64) if bad else kl, vl), {}),
             ("head size", tuple(x[..., :4] if bad else x for x in (ql, kl, vl)), {}),
             ("layout", (ql, kl, vl), {"layout": "zigzag" if bad else "contiguous"})]
    lines = []
    for what, args, kwargs in calls:
        try:
            fd.ring_attention(*args, **kwargs)
            lines.append(f"rank {rank} {what}: no error")
        except (TypeError, ValueError) as e:
            lines.append(f"rank {rank} {what}: {type(e).__name__}: {e}")
    try:
        fd.gather(ql[..., :4] if bad else ql)
        lines.append(f"rank {rank} gather: no error")
    except ValueError as e:
        lines.append(f"rank {rank} gather: ValueError: {e}")
    everyone = comm.gather(lines)
    if rank == 0:
        print("\n".join(line for mine in everyone for line in mine), flush=True)


def bad_args_collective(comm) -> None:
    """Issue 32 item 4: arguments that used to fail on rank 1 alone, before
    the agreement, leaving rank 0 waiting forever: a bad comm (NumPy API,
    forward, backward and gather), a bad gather axis or layout, and, in
    flashattn.torch.ring_attention, a NumPy array or another dtype than the
    other ranks'. Each rank's line per call; rank 0 prints them all. Then
    bfloat16 tensors on every rank run and equal the NumPy ring's."""
    import torch

    import flashattn.torch as fat

    rank = comm.Get_rank()
    bad = rank == 1
    q, k, v, do = helpers.inputs(helpers.Case(1, 16, 16, 2, 2, 8), seed=3)
    ql, kl, vl, dol = (fd.shard(x) for x in (q, k, v, do))
    o, lse = fd.ring_attention(ql, kl, vl)
    tq, tk, tv = (torch.from_numpy(x.copy()) for x in (ql, kl, vl))
    calls = [
        ("numpy comm", lambda: fd.ring_attention(ql, kl, vl, comm="world" if bad else None)),
        ("numpy backward comm", lambda: fd.ring_attention_backward(
            dol, ql, kl, vl, o, lse, comm=42 if bad else None)),
        ("gather comm", lambda: fd.gather(ql, comm=[] if bad else None)),
        ("gather axis", lambda: fd.gather(ql, axis=9 if bad else 1)),
        ("gather layout", lambda: fd.gather(ql, layout="spiral" if bad else "contiguous")),
        ("torch numpy", lambda: fat.ring_attention(ql if bad else tq, tk, tv)),
        ("torch bfloat16", lambda: fat.ring_attention(
            tq.bfloat16() if bad else tq, tk.bfloat16() if bad else tk,
            tv.bfloat16() if bad else tv)),
        ("torch comm", lambda: fat.ring_attention(tq, tk, tv, comm="world" if bad else None)),
    ]
    lines = []
    for what, call in calls:
        try:
            call()
            lines.append(f"rank {rank} {what}: no error")
        except (TypeError, ValueError) as e:
            lines.append(f"rank {rank} {what}: {type(e).__name__}: {e}")
    ob = fat.ring_attention(tq.bfloat16(), tk.bfloat16(), tv.bfloat16())
    bf = ml_dtypes.bfloat16
    on, _ = fd.ring_attention(ql.astype(bf), kl.astype(bf), vl.astype(bf))
    same = np.array_equal(ob.view(torch.int16).numpy(), on.view(np.int16))
    lines.append(f"rank {rank} torch bfloat16 everywhere: {ob.dtype} same as numpy: {same}")
    everyone = comm.gather(lines)
    if rank == 0:
        print("\n".join(line for mine in everyone for line in mine), flush=True)


def torch_ring(comm) -> None:
    """flashattn.torch.ring_attention: o and the autograd gradients equal
    flashattn.distributed's, bit for bit; gathered o matches one process."""
    import torch

    import flashattn.torch as fat

    rank = comm.Get_rank()
    case = helpers.Case(2, 45, 45, 4, 2, 16, causal=True)
    q, k, v, do = helpers.inputs(case, seed=5)
    ql, kl, vl, dol = (fd.shard(x, layout="zigzag") for x in (q, k, v, do))
    opts = dict(causal=True, layout="zigzag")
    qt, kt, vt = (torch.from_numpy(x.copy()).requires_grad_() for x in (ql, kl, vl))
    o_t = fat.ring_attention(qt, kt, vt, **opts)
    (o_t * torch.from_numpy(dol)).sum().backward()
    o, lse = fd.ring_attention(ql, kl, vl, **opts)
    grads = fd.ring_attention_backward(dol, ql, kl, vl, o, lse, **opts)
    same = bool(np.array_equal(o_t.detach().numpy(), o)) and all(
        np.array_equal(t.grad.numpy(), g) for t, g in zip((qt, kt, vt), grads))
    o_full = fd.gather(o_t.detach().numpy(), layout="zigzag")
    single = fa.attention(q, k, v, causal=True)
    diff = float(np.max(np.abs(o_full - single)))
    everyone = comm.gather((rank, same, diff))
    if rank == 0:
        for r, same, diff in everyone:
            print(f"torch rank {r}: same as flashattn.distributed: {same}; "
                  f"max |o - single process| {diff:.2e}", flush=True)


def main(argv: list[str]) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if argv[:1] == ["--fail-rank"]:
        fail_mid_ring(comm, int(argv[1]))
        return 0
    if argv[:1] == ["--torch"]:
        torch_ring(comm)
        return 0
    if argv[:1] == ["--bad-args-collective"]:
        bad_args_collective(comm)
        return 0
    if argv[:1] == ["--bad-args"]:
        bad_args(comm)
        return 0
    records = []
    for case in CASES:
        if case.backend is not None and case.backend not in fa.backends():
            continue
        record = run_case(case, comm)
        if record is not None:
            records.append(record)
    if comm.Get_rank() == 0:
        with open(argv[0], "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
