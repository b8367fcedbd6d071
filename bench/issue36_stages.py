"""Issue 36: one shape's backward, called --calls times after a warm-up, at
--threads; with FLASHATTN_CPU_PROFILE=1 the pool's record of each
parallel_for of the last call (tasks, wall, utilisation, longest task).
(docs/cpu-limits.md's per-stage cycle counts came from this script on a
temporary build with rdtsc counters around each stage of query_tile.)"""
import argparse
import os
import time

import flashattn as fa
from flashattn import _core
from flashattn.cli.bench.cpu import Problem

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="2,4096,16,4,128,1")
ap.add_argument("--dtype", default="bf16")
ap.add_argument("--threads", type=int, default=16)
ap.add_argument("--calls", type=int, default=5)
a = ap.parse_args()
B, T, H, Hkv, D, c = (int(x) for x in a.shape.split(","))
fa.set_num_threads(a.threads)
pr = Problem(B, T, H, Hkv, D, bool(c), dtype=a.dtype)
o, lse = pr.forward_outputs()
pr.ours_backward(o, lse)
ts = []
for _ in range(a.calls):
    if os.environ.get("FLASHATTN_CPU_PROFILE"):
        _core._cpu_pool_profile()
    t0 = time.perf_counter()
    pr.ours_backward(o, lse)
    ts.append(time.perf_counter() - t0)
rows = _core._cpu_pool_profile() if os.environ.get("FLASHATTN_CPU_PROFILE") else []
print(f"{a.dtype} {a.shape} threads={a.threads} bwd min {min(ts) * 1e3:.2f} ms "
      f"median {sorted(ts)[len(ts) // 2] * 1e3:.2f} ms", flush=True)
for tasks, threads, wall, busy, longest in rows:
    print(f"  parallel_for {int(tasks)} tasks {wall * 1e3:.2f} ms util {busy / (threads * wall):.2f} "
          f"longest {longest / wall:.2f}", flush=True)
