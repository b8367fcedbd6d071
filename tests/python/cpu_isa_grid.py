"""A reduced grid of the cpu engine's cases, forward and backward, against
the float64 reference (the tolerance rule of helpers.py), on whichever
instruction-set path this process uses: run it with FLASHATTN_CPU_ISA set.
test_cpu_dispatch.py runs it once per path this CPU supports, and
tests/qemu_wheel.sh runs it under emulated CPUs (AVX2-only, baseline).

usage: python tests/python/cpu_isa_grid.py      (prints the path, then "ok")
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashattn as fa  # noqa: E402
from helpers import DTYPES, Case, check_backward, check_forward, inputs  # noqa: E402

CASES = [
    Case(1, 100, 100, 2, 2, 64, causal=True),
    Case(2, 113, 203, 4, 2, 59),                      # Tq < Tk, GQA, odd D
    Case(1, 203, 113, 3, 1, 64, causal=True),         # rows that see no key, MQA
    Case(1, 1, 150, 4, 4, 128, causal=True),          # decoding
    Case(1, 70, 70, 2, 1, 1, causal=True),            # D = 1
    Case(1, 130, 140, 2, 1, 256, causal=True),        # D = 256
    Case(1, 150, 150, 4, 2, 64, causal=True, window=(31, 0)),
    Case(1, 111, 77, 2, 2, 40, window=(10, 20)),
]


def main() -> int:
    print(f"cpu path: {fa.cpu_isa()}", flush=True)
    for i, case in enumerate(CASES):
        # float16 and bfloat16 (their loads: F16C, AVX-512, or scalar) on
        # the first cases, float32 on all.
        for name, dtype in DTYPES.items() if i < 4 else [("f32", DTYPES["f32"])]:
            q, k, v, do = inputs(case, seed=i, dtype=dtype)
            check_forward("cpu", case, q, k, v)
            check_backward("cpu", case, q, k, v, do)
            print(f"  {case.id} {name}: ok", flush=True)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
