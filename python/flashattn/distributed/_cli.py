"""``python -m flashattn.distributed demo|bench``, run under mpiexec:

    mpiexec -n 4 python -m flashattn.distributed demo
    mpiexec -n 4 python -m flashattn.distributed bench --seq 16384 --json out.json

Each rank makes only its own shard of the inputs (rows come from seeded
blocks of 256, so any rank can make any rows), runs ring attention forward
and backward, and reports its time, the time it sat in MPI waits and its
peak resident memory. ``demo`` then gathers the results and compares them
with one process running fa.attention / fa.attention_backward on the whole
sequence; ``bench`` also times the same ring with the engine calls left out
(communication alone), to tell how much of it the compute hid.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np

from . import _ring
from . import _plan as plan
from ..cli.args import positive_int

_BLOCK = 256  # rows per seeded block of the synthetic inputs


def _fill_rows(out: np.ndarray, seed: int, tensor: int, start: int) -> None:
    """Fills ``out`` (B, n, heads, D) with rows [start, start + n) of a
    standard-normal array whose rows come in seeded blocks: the same values
    whichever rank makes them, and no temporary larger than one block."""
    B, n, heads, D = out.shape
    stop = start + n
    for block in range(start // _BLOCK, (stop + _BLOCK - 1) // _BLOCK if n else 0):
        rng = np.random.default_rng([seed, tensor, block])
        x = rng.standard_normal((B, _BLOCK, heads, D), dtype=np.float32)
        first = block * _BLOCK
        lo, hi = max(start, first), min(stop, first + _BLOCK)
        out[:, lo - start:hi - start] = x[:, lo - first:hi - first]


def _shard_lengths(layout: str, T: int, size: int) -> list[int]:
    if layout == "zigzag":
        return [plan.zigzag_length(T, size, r) for r in range(size)]
    return [len(part) for part in np.array_split(np.arange(T), size)]


def _inputs(args, rank: int, size: int):
    """This rank's q, k, v, do (or the whole sequence's, rank=None)."""
    T, B, H, Hkv, D = args.seq, args.batch, args.heads, args.kv_heads, args.dim
    if rank is None:
        segs = [plan.Segment(0, T, 0)]
    else:
        segs = plan.segments(args.layout, _shard_lengths(args.layout, T, size), rank)

    def make(tensor, heads):
        x = np.empty((B, sum(s.length for s in segs), heads, D), np.float32)
        for s in segs:
            _fill_rows(x[:, s.local:s.local + s.length], args.seed, tensor, s.start)
        return x

    return make(0, H), make(1, Hkv), make(2, Hkv), make(3, H)


def _peak_rss() -> int:
    """Peak resident memory of this process so far, in bytes."""
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"mpiexec -n P python -m flashattn.distributed {command}")
    p.add_argument("--seq", type=positive_int, default=4096, help="global sequence length T")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--kv-heads", type=positive_int, default=2)
    p.add_argument("--dim", type=positive_int, default=64)
    p.add_argument("--no-causal", dest="causal", action="store_false", help="full attention")
    p.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"))
    p.add_argument("--layout", choices=plan.LAYOUTS, default="zigzag")
    p.add_argument("--backend", default=None)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="cpu engine threads per rank (default: cores / ranks, at least 1)")
    p.add_argument("--seed", type=int, default=0)
    if command == "bench":
        p.add_argument("--no-backward", dest="backward", action="store_false")
        p.add_argument("--json", default=None, help="also write rank 0's summary here")
        p.add_argument("--mem-limit", type=positive_int, default=None, metavar="MIB",
                       help="cap each process's private writable memory (RLIMIT_DATA, "
                       "Linux) at this many MiB before the inputs are made")
        p.add_argument("--single", action="store_true",
                       help="no MPI: one process runs fa.attention and its backward on the "
                       "whole sequence (the comparison for --mem-limit)")
    return p


def _run_ring(args, comm, q, k, v, do, backward: bool, dry: bool):
    """One forward (and backward) on this rank's shards: outputs and Stats."""
    from .. import distributed as fd

    window = tuple(args.window)
    fwd, bwd = _ring.Stats(dry), _ring.Stats(dry)
    comm.Barrier()
    o, lse = fd._forward(q, k, v, comm, args.causal, window, None, args.layout, args.backend, fwd)
    grads = None
    if backward:
        comm.Barrier()
        grads = fd._backward(do, q, k, v, o, lse, comm, args.causal, window, None, args.layout,
                             args.backend, bwd)
    return o, lse, grads, fwd, bwd


def _setup(argv, command):
    from . import _comm as _ring_comm
    import flashattn as fa

    args = _parser(command).parse_args(argv)
    # communicator() refuses a mismatched launch (issue 32 item 5)
    MPI, comm = _ring_comm.communicator(f"python -m flashattn.distributed {command}", None)
    rank, size = comm.Get_rank(), comm.Get_size()
    threads = args.threads or max(1, (os.cpu_count() or 1) // size)
    fa.set_num_threads(threads)
    return args, comm, rank, size, threads


def _stats_line(rank, n, s_f, s_b, rss):
    def ms(x):
        return f"{x * 1e3:9.1f}"

    return (f"  rank {rank:>3}  rows {n:>8}  fwd {ms(s_f.total)} ms (wait {ms(s_f.wait)})  "
            f"bwd {ms(s_b.total)} ms (wait {ms(s_b.wait)})  blocks {s_f.blocks:>3} "
            f"(skipped {s_f.skipped:>3})  peak RSS {rss / 2**20:8.1f} MiB")


def demo(argv) -> int:
    import flashattn as fa
    from .. import distributed as fd

    args, comm, rank, size, threads = _setup(argv, "demo")
    q, k, v, do = _inputs(args, rank, size)
    o, lse, (dq, dk, dv), s_f, s_b = _run_ring(args, comm, q, k, v, do, True, False)
    rss = _peak_rss()  # before anything of the whole sequence exists on this rank
    report = comm.gather((rank, q.shape[1], s_f, s_b, rss))
    full = [fd.gather(x, comm=comm, layout=args.layout) for x in (o, dq, dk, dv)]
    lse_full = fd.gather(lse, comm=comm, layout=args.layout, axis=2)
    if rank != 0:
        return 0
    print(f"ring attention over {size} rank(s): B={args.batch} T={args.seq} H={args.heads} "
          f"Hkv={args.kv_heads} D={args.dim} causal={args.causal} window={tuple(args.window)} "
          f"layout={args.layout} backend={args.backend or fa.backends()[0]}, {threads} cpu "
          f"thread(s) per rank, {os.cpu_count()} cores on this machine")
    for line in report:
        print(_stats_line(*line))
    qf, kf, vf, dof = _inputs(args, None, size)
    opts = dict(causal=args.causal, window=tuple(args.window), backend=args.backend)
    fa.set_num_threads(os.cpu_count() or 1)
    t = time.perf_counter()
    o1, lse1 = fa.attention(qf, kf, vf, return_lse=True, **opts)
    t_f = time.perf_counter() - t
    t = time.perf_counter()
    grads1 = fa.attention_backward(dof, qf, kf, vf, o1, lse1, **opts)
    t_b = time.perf_counter() - t
    print(f"  one process, {fa.get_num_threads()} thread(s), whole sequence: fwd "
          f"{t_f * 1e3:.1f} ms, bwd {t_b * 1e3:.1f} ms")
    print("error of the ring against one process (max |ring - single|, and relative to "
          "max |single|):")
    worst = 0.0
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), [full[0], lse_full, *full[1:]],
                               [o1, lse1, *grads1]):
        finite = np.isfinite(want)
        err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
        rel = err / max(float(np.max(np.abs(want[finite]), initial=0.0)), 1e-30)
        worst = max(worst, rel)
        print(f"  {name:<4} {err:.3e}  ({rel:.2e} relative)")
    ok = worst < 1e-4
    print(f"verdict: {'PASS' if ok else 'FAIL'} (worst relative error {worst:.2e}, limit 1e-4)")
    return 0 if ok else 1


def _limit_memory(mib: int | None) -> None:
    if mib is not None:
        limit = mib * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _vm_data() -> int | None:
    """Private writable memory mapped now (what RLIMIT_DATA caps), Linux only."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def bench_single(argv) -> int:
    """One process, the whole sequence, under the same memory cap."""
    import flashattn as fa

    args = _parser("bench").parse_args(argv)
    fa.set_num_threads(args.threads or os.cpu_count() or 1)
    _limit_memory(args.mem_limit)
    opts = dict(causal=args.causal, window=tuple(args.window), backend=args.backend)
    result = {"single": True, "T": args.seq, "mem_limit_mib": args.mem_limit}
    try:
        q, k, v, do = _inputs(args, None, 1)
        t, cpu = time.perf_counter(), time.process_time()
        o, lse = fa.attention(q, k, v, return_lse=True, **opts)
        if args.backward:
            fa.attention_backward(do, q, k, v, o, lse, **opts)
        result.update(seconds=time.perf_counter() - t, cpu_s=time.process_time() - cpu,
                      peak_rss_bytes=_peak_rss())
    except MemoryError as e:
        result.update(error=f"MemoryError: {e}", peak_rss_bytes=_peak_rss())
    print(json.dumps(result))
    return 0


def bench(argv) -> int:
    import flashattn as fa

    if "--single" in argv:
        return bench_single(argv)
    args, comm, rank, size, threads = _setup(argv, "bench")
    _limit_memory(args.mem_limit)
    q, k, v, do = _inputs(args, rank, size)
    inputs_rss = _peak_rss()
    _run_ring(args, comm, q, k, v, do, args.backward, False)  # warm-up
    cpu = time.process_time()
    _, _, _, s_f, s_b = _run_ring(args, comm, q, k, v, do, args.backward, False)
    cpu = time.process_time() - cpu  # this rank's CPU seconds, all its threads
    rss = _peak_rss()
    _, _, _, d_f, d_b = _run_ring(args, comm, q, k, v, do, args.backward, True)
    mine = {"rank": rank, "rows": q.shape[1], "threads": threads, "cpu_s": cpu,
            "fwd_s": s_f.total, "fwd_wait_s": s_f.wait, "fwd_compute_s": s_f.compute,
            "bwd_s": s_b.total, "bwd_wait_s": s_b.wait, "bwd_compute_s": s_b.compute,
            "comm_alone_fwd_s": d_f.total, "comm_alone_bwd_s": d_b.total,
            "blocks": s_f.blocks, "skipped": s_f.skipped,
            "received_bytes": s_f.received + s_b.received, "hidden_bytes": s_f.hidden + s_b.hidden,
            "peak_rss_bytes": rss, "rss_after_inputs_bytes": inputs_rss,
            "vm_data_bytes": _vm_data()}
    everyone = comm.gather(mine)
    if rank != 0:
        return 0
    summary = {"P": size, "T": args.seq, "B": args.batch, "H": args.heads, "Hkv": args.kv_heads,
               "D": args.dim, "causal": args.causal, "window": list(args.window),
               "layout": args.layout, "backend": args.backend or fa.backends()[0],
               "cores": os.cpu_count(), "mem_limit_mib": args.mem_limit, "ranks": everyone}
    for r in everyone:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def main(argv) -> int:
    commands = {"demo": demo, "bench": bench}
    if not argv or argv[0] not in commands:
        print("usage: mpiexec -n P python -m flashattn.distributed {demo,bench} [options]\n"
              "  demo   ring forward + backward: each rank's time and peak memory, and the "
              "error against one process\n"
              "  bench  per-rank time, peak memory and the share of communication hidden "
              "behind compute (bench/bench_ring.py runs it for several P)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
