"""argparse value types shared by the command-line subcommands: a bad value
is a usage error (exit status 2, with the option and the value), never a
child process that fails while its parent waits."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int >= 1 (for sizes, repeat counts and thread counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
