"""Engines this build has (or would have elsewhere) that are not usable here,
and why: a RuntimeWarning at import when an engine was built but failed to
start (a metallib that does not load, a bad FLASHATTN_METALLIB, a device that
does not initialise or cannot run the kernels), and the reasons `python -m
flashattn` prints. The other engines keep working either way."""

from __future__ import annotations

import warnings

from . import _core


def missing() -> dict[str, tuple[str, bool]]:
    """{engine name: (reason, failed)}; failed means it was built but could not start."""
    return {name: (reason, bool(failed)) for name, reason, failed in _core._engines_missing()}


def warn_about_failed_engines() -> None:
    for name, (reason, failed) in missing().items():
        if failed:
            # No colon in the first words: pyproject's filterwarnings matches them.
            warnings.warn(f"flashattn engine unavailable, {name!r} left out of backends(). "
                          f"Reason: {reason}", RuntimeWarning, stacklevel=3)
