"""Command line (``python -m flashattn``, or the ``flashattn`` console
script): the main job ``report`` (the default) checks this machine's engines
against the float64 reference, times them next to plain NumPy and ends with
one verdict line; ``bench`` compares the cpu engine with PyTorch (``bench
--backend metal``: the metal engine with MLX); ``train`` trains a small
transformer with flashattn's attention and with torch SDPA; ``info`` shows
the build, the engines and the cpu engine's instruction-set path."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional


def _report(argv: List[str]) -> int:
    from .cli import report

    return int(report.main(argv))


def _bench(argv: List[str]) -> int:
    from .cli import bench

    return int(bench.main(argv))


def _train(argv: List[str]) -> int:
    from .cli import train  # the training example (examples/train_gpt.py)

    return int(train.main(argv))


def _info(argv: List[str]) -> int:
    from .cli import info

    return int(info.main(argv))


_COMMANDS: Dict[str, Callable[[List[str]], int]] = {
    "report": _report,
    "bench": _bench,
    "train": _train,
    "info": _info,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashattn",
        description="flashattn: exact fused attention for NumPy. Each subcommand has its "
        "own --help.",
        epilog="Without a subcommand, runs `report` with the options given, e.g. "
        "`python -m flashattn --seq 1024`. The exit status is 0 on success, 1 when a "
        "correctness check fails, 2 for bad arguments.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{report,bench,train,info}")
    sub.add_parser("report", add_help=False,
                   help="(the default) engines found, correctness against the float64 "
                   "reference, time and memory next to plain NumPy; one verdict line")
    sub.add_parser("bench", add_help=False,
                   help="the cpu engine against PyTorch's scaled_dot_product_attention "
                   "(--backend metal: the metal engine against MLX)")
    sub.add_parser("train", add_help=False,
                   help="train a small character-level transformer with flashattn and with "
                   "torch SDPA, side by side (needs torch)")
    sub.add_parser("info", add_help=False,
                   help="version, platform, engines, the cpu engine's instruction set")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        _parser().print_help()
        return 0
    if args and args[0] in _COMMANDS:
        return _COMMANDS[args[0]](args[1:])
    if args and not args[0].startswith("-"):
        _parser().error(f"unknown subcommand {args[0]!r} (choose from report, bench, train, info)")
    return _report(args)


if __name__ == "__main__":
    sys.exit(main())
