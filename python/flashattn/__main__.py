"""Command line: `python -m flashattn` reports on this machine's engines
(correctness, time and memory against plain NumPy); `python -m flashattn
bench` compares the cpu engine with PyTorch; `python -m flashattn train` trains
a small transformer with flashattn's attention and with torch SDPA."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from . import _bench

        return _bench.main(argv[1:])
    if argv and argv[0] == "train":  # issue 17: the training example (flashattn/_train.py)
        from . import _train

        return _train.main(argv[1:])
    from . import _report

    return _report.main(argv)


if __name__ == "__main__":
    sys.exit(main())
