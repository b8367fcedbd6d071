"""Ring attention (flashattn.distributed) on this machine: per-rank time
and peak memory against the number of ranks P, and how much of the
communication the compute hid. Starts ``mpiexec -n P python -m
flashattn.distributed bench ...`` for each P and prints two tables:

1. memory: a long sliding-window sequence under a per-process cap on private
   writable memory (RLIMIT_DATA, set by each process on itself): one process
   holding the whole sequence, then P ranks each holding T/P of it;
2. scaling: causal attention, forward + backward, for P = 1, 2, 4.

    python bench/bench_ring.py              # both tables
    python bench/bench_ring.py --quick      # smaller sizes, for a smoke run

Every rank runs the cpu engine with cores / P threads (at least 1); when P
exceeds the cores, the ranks share them. Columns: time (the slowest rank's
wall time), compute (its time in engine calls and merges), waiting (its time
blocked in MPI waits: messages not yet in, or a slower neighbour), comm alone
(the same ring with the engine calls left out), bytes hidden (the share of
received bytes that were complete when the compute of their step ended),
CPU s (process CPU time summed over the ranks: the total work).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def _run(ranks: int | None, args: list[str]) -> dict:
    """One bench run: P ranks under mpiexec, or one process (ranks=None)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        base = [sys.executable, "-m", "flashattn.distributed", "bench", *args]
        if ranks is None:
            r = subprocess.run(base + ["--single"], capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                raise RuntimeError(f"single-process bench failed:\n{r.stderr}")
            return json.loads(r.stdout.strip().splitlines()[-1])
        r = subprocess.run([_mpiexec(), "-n", str(ranks), *base, "--json", str(out)],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            last = [line for line in r.stderr.splitlines() if "failed inside the ring" in line]
            return {"P": ranks, "error": last[0] if last else r.stderr[-2000:]}
        return json.loads(out.read_text())


def _mib(x) -> str:
    return f"{x / 2**20:.0f}"


def _ranks_row(s: dict) -> tuple:
    """Worst rank's time and memory, and the share of bytes hidden."""
    ranks = s["ranks"]
    total = max(r["fwd_s"] + r["bwd_s"] for r in ranks)
    compute = max(r["fwd_compute_s"] + r["bwd_compute_s"] for r in ranks)
    wait = max(r["fwd_wait_s"] + r["bwd_wait_s"] for r in ranks)
    alone = max(r["comm_alone_fwd_s"] + r["comm_alone_bwd_s"] for r in ranks)
    received = sum(r["received_bytes"] for r in ranks)
    hidden = sum(r["hidden_bytes"] for r in ranks)
    rss = max(r["peak_rss_bytes"] for r in ranks)
    cpu = sum(r["cpu_s"] for r in ranks)
    share = f"{hidden / received:.0%}" if received else "-"
    return total, compute, wait, alone, share, rss, cpu


def memory_table(args) -> None:
    T = args.mem_seq
    shape = ["--seq", str(T), "--heads", "4", "--kv-heads", "1", "--dim", "32", "--window", "255",
             "0", "--layout", "contiguous"]
    cap = ["--mem-limit", str(args.mem_limit)]
    print(f"\n1. memory: B=1 T={T} H=4 Hkv=1 D=32, causal window (255, 0), forward + backward; "
          f"cap {args.mem_limit} MiB of private writable memory (RLIMIT_DATA) per process")
    print("| run | cap | result | time s (worst rank) | peak RSS MiB (worst rank) |")
    print("| --- | --- | --- | --- | --- |")
    for capped in (False, True):
        print(f"  running one process{' under the cap' if capped else ''} ...", file=sys.stderr)
        s = _run(None, shape + (cap if capped else []))
        result = s.get("error", "ok")
        secs = f"{s['seconds']:.2f}" if "seconds" in s else "-"
        print(f"| 1 process, whole sequence | {'yes' if capped else 'none'} | {result} | {secs} | "
              f"{_mib(s['peak_rss_bytes'])} |")
    for P in (2, 4):
        for capped in (False, True):
            print(f"  running P={P}{' under the cap' if capped else ''} ...", file=sys.stderr)
            s = _run(P, shape + (cap if capped else []))
            if "error" in s:
                print(f"| {P} ranks, T/{P} each | {'yes' if capped else 'none'} | {s['error']} "
                      "| - | - |")
                continue
            total, _, _, _, _, rss, _ = _ranks_row(s)
            print(f"| {P} ranks, T/{P} each | {'yes' if capped else 'none'} | ok | {total:.2f} | "
                  f"{_mib(rss)} |")


def scaling_table(args) -> None:
    T = args.seq
    shape = ["--seq", str(T), "--heads", "8", "--kv-heads", "2", "--dim", "64", "--layout",
             "zigzag"]
    print(f"\n2. scaling: B=1 T={T} H=8 Hkv=2 D=64 causal, zigzag, forward + backward, "
          f"{os.cpu_count()} cores")
    print("| P | threads/rank | time s | compute s | waiting s | comm alone s | bytes hidden | "
          "CPU s, all ranks | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for P in (1, 2, 4):
        print(f"  running P={P} ...", file=sys.stderr)
        s = _run(P, shape)
        total, compute, wait, alone, share, rss, cpu = _ranks_row(s)
        threads = s["ranks"][0]["threads"]
        print(f"| {P} | {threads} | {total:.2f} | {compute:.2f} | {wait:.3f} | {alone:.3f} | "
              f"{share} | {cpu:.2f} | {_mib(rss)} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--seq", type=int, default=8192, help="T of the scaling table")
    p.add_argument("--mem-seq", type=int, default=524288, help="T of the memory table")
    p.add_argument("--mem-limit", type=int, default=768, help="MiB per process")
    p.add_argument("--only", choices=("memory", "scaling"), default=None)
    args = p.parse_args()
    if args.quick:
        args.seq, args.mem_seq, args.mem_limit = 1024, 65536, 260
    if args.only != "scaling":
        memory_table(args)
    if args.only != "memory":
        scaling_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
