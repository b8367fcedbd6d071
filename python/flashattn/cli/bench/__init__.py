"""`python -m flashattn bench`: picks the benchmark the arguments ask for.

- ``bench`` (cpu.py): the cpu engine in float32 against torch SDPA, then
  the sliding-window, memory and machine-limit sections (limits.py);
- ``bench --dtype bf16|fp16`` (dtype.py): the same shapes in that dtype;
- ``bench options`` (options.py): the score options and varlen;
- ``bench --backend metal`` (metal.py): the metal engine against MLX."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["options"]:  # the score options' cost and varlen (issue 16)
        from . import options

        return options.main(argv[1:])
    if any(a == "--backend" or a.startswith("--backend=") for a in argv):
        from . import metal  # the GPU engines' bench (metal against MLX)

        return metal.main(argv)
    if any(a == "--dtype" or a.startswith("--dtype=") for a in argv):
        from . import dtype  # float16 / bfloat16 against torch in the same dtype

        return dtype.main(argv)
    from . import cpu

    return cpu.main(argv)
