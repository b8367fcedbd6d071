"""The dispatched cpu engine against a -march=native build of the same
source, side by side: forward, and forward + backward, float32, same
thread count. Each build is a Python environment with flashattn installed
(the native one with -Ccmake.define.FLASHATTN_NATIVE=ON); the two can't
share a process (one module name), so each timing is a child process, and
the children alternate between the builds round after round. The table shows
the minimum over all runs of each build and the ratio dispatched / native
(above 1: the dispatched build is slower). `uptime` is printed before and
after: on a shared machine, load moves every number. `--clock cpu` times
the process's CPU time instead of wall time (use it with `--threads 1`): a
loaded machine then delays the runs but inflates them much less.

usage: python bench/bench_dispatch.py --native ENV/bin/python
           [--dispatched ENV/bin/python] [--isa avx2 ...] [--rounds 5] [--repeat 3]
           [--threads N] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# (B, T, H, Hkv, D, causal)
SHAPES = [
    (1, 2048, 8, 8, 64, True),    # the shape of issue 13's numbers
    (1, 1024, 8, 8, 64, False),
    (4, 512, 8, 8, 64, True),
    (1, 2048, 32, 8, 128, True),
    (8, 256, 4, 4, 32, False),
]

CHILD = r"""
import json, sys, time
import numpy as np
import flashattn as fa
B, T, H, Hkv, D, causal = json.loads(sys.argv[1]); repeat = int(sys.argv[2])
if int(sys.argv[3]) > 0:
    fa.set_num_threads(int(sys.argv[3]))
clock = time.process_time if sys.argv[4] == "cpu" else time.perf_counter
rng = np.random.default_rng(0)
q = rng.standard_normal((B, T, H, D), dtype=np.float32)
k = rng.standard_normal((B, T, Hkv, D), dtype=np.float32)
v = rng.standard_normal((B, T, Hkv, D), dtype=np.float32)
do = rng.standard_normal((B, T, H, D), dtype=np.float32)
fwd, total = [], []
for i in range(repeat + 1):  # the first warms up
    t0 = clock()
    o, lse = fa.attention(q, k, v, causal=causal, return_lse=True, backend="cpu")
    t1 = clock()
    fa.attention_backward(do, q, k, v, o, lse, causal=causal, backend="cpu")
    t2 = clock()
    if i:
        fwd.append(t1 - t0); total.append(t2 - t0)
print(json.dumps({"isa": fa.cpu_isa(), "threads": fa.get_num_threads(),
                  "fwd": fwd, "total": total}))
"""


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def child(python: str, isa: str | None, shape, repeat: int, threads: int = 0,
          clock: str = "wall") -> dict:
    env = dict(os.environ)
    env.pop("FLASHATTN_CPU_ISA", None)
    if isa:
        env["FLASHATTN_CPU_ISA"] = isa
    out = subprocess.run([python, "-c", CHILD, json.dumps(shape), str(repeat), str(threads),
                          clock], env=env,
                         capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--native", required=True, help="python of the -march=native build")
    parser.add_argument("--dispatched", default=sys.executable,
                        help="python of the dispatched build (default: this one)")
    parser.add_argument("--isa", action="append", default=[],
                        help="also time the dispatched build forced to this path (repeatable)")
    parser.add_argument("--rounds", type=int, default=5, help="alternations per shape")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per child")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads of the cpu engine (default: its default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or the process's CPU time")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeat < 1:
        parser.error("--rounds and --repeat must be at least 1")

    builds = [("native", args.native, None), ("dispatched", args.dispatched, None)]
    builds += [(f"dispatched:{isa}", args.dispatched, isa) for isa in args.isa]
    print(f"before: {uptime()}", flush=True)
    results = []
    for shape in SHAPES:
        runs: dict = {name: {"fwd": [], "total": []} for name, _, _ in builds}
        isas = {}
        for r in range(args.rounds):
            order = builds if r % 2 == 0 else builds[::-1]  # interleaved, both orders
            for name, python, isa in order:
                res = child(python, isa, shape, args.repeat, args.threads, args.clock)
                runs[name]["fwd"] += res["fwd"]
                runs[name]["total"] += res["total"]
                isas[name] = res["isa"]
                threads = res["threads"]
            print(f"  {shape}: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        results.append((shape, runs, isas))
    print(f"after:  {uptime()}")
    print(f"\nfloat32, {threads} threads, {args.clock} clock, min of {args.rounds * args.repeat} runs per build "
          f"({args.rounds} alternating child processes x {args.repeat} after a warm-up)")
    names = [name for name, _, _ in builds]
    print("paths: " + ", ".join(f"{n} = {isas[n]}" for n in names))
    head = f"{'B, T, H/Hkv, D, mask':<26}"
    for n in names:
        head += f" {n + ' fwd':>18}" + ("" if n == "native" else f" {'ratio':>6}")
    for n in names:
        head += f" {n + ' f+b':>18}" + ("" if n == "native" else f" {'ratio':>6}")
    print(head)
    for (B, T, H, Hkv, D, causal), runs, _ in results:
        line = f"{f'{B}, {T}, {H}/{Hkv}, {D}, ' + ('causal' if causal else 'full'):<26}"
        for kind in ("fwd", "total"):
            base = min(runs["native"][kind])
            for n in names:
                t = min(runs[n][kind])
                line += f" {t * 1e3:18.1f}" + ("" if n == "native" else f" {t / base:6.3f}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
