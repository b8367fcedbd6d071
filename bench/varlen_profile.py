"""Issue 34 probe: a varlen backward against the dense batch of the same work.

256 sequences of 64 tokens (H = 8, D = 64, causal), in one varlen call and as
one dense (256, 64) batch, interleaved, 15 runs each; for each one's fastest
run, the pool's record of its parallel_for calls (FLASHATTN_CPU_PROFILE=1:
tasks, threads, wall, busy summed over the threads, longest task). What the
calls' walls leave of the total ran on one thread.

    python bench/varlen_profile.py [THREADS]
"""
import os
import sys
import time

import numpy as np

os.environ["FLASHATTN_CPU_PROFILE"] = "1"  # read at the pool's first use
import flashattn as fa  # noqa: E402
from flashattn import _api, _core  # noqa: E402


def main():
    fa.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else fa.get_num_threads())
    H, D, L, T = 8, 64, 256, 64
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((L * T, H, D), dtype=np.float32) for _ in range(4))
    cu = np.arange(0, L * T + 1, T).astype(np.int32)
    qd, kd, vd, dod = (x.reshape(L, T, H, D) for x in (q, k, v, do))
    o, lse = fa.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True, backend="cpu")
    od, lsed = fa.attention(qd, kd, vd, causal=True, return_lse=True, backend="cpu")
    calls = {
        "varlen": lambda: _api._attention_varlen_backward(
            do, q, k, v, o, lse, cu, cu, None, None, True, (-1, -1), None, 0.0, None, None,
            "cpu", False),
        "dense": lambda: fa.attention_backward(dod, qd, kd, vd, od, lsed, causal=True,
                                               backend="cpu"),
    }
    best = {name: (float("inf"), []) for name in calls}
    for _ in range(15):
        for name, call in calls.items():
            _core._cpu_pool_profile()  # forget what came before
            t0 = time.perf_counter()
            call()
            t = time.perf_counter() - t0
            record = _core._cpu_pool_profile()
            if t < best[name][0]:
                best[name] = (t, record)
    print(f"backward, {L} x {T}, H={H}, D={D}, causal, {fa.get_num_threads()} threads")
    for name, (t, record) in best.items():
        walls = sum(row[2] for row in record)
        print(f"{name}: {t * 1e3:.2f} ms, {len(record)} parallel_for calls "
              f"({walls * 1e3:.2f} ms; the rest {(t - walls) * 1e3:.2f} ms)")
        for tasks, threads, wall, busy, longest in record:
            print(f"    {int(tasks):6d} tasks  wall {wall * 1e3:7.3f} ms  busy {busy * 1e3:8.3f} ms"
                  f"  longest task {longest * 1e3:6.3f} ms")


if __name__ == "__main__":
    main()
