"""Command line: `python -m flashattn` reports on this machine's engines
(correctness, time and memory against plain NumPy); `python -m flashattn
bench` compares the cpu engine with PyTorch."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from . import _bench

        return _bench.main(argv[1:])
    from . import _report

    return _report.main(argv)


if __name__ == "__main__":
    sys.exit(main())
