"""Which instruction-set path the cpu engine runs: its kernels are compiled
for several (``avx512``, ``avx2``, ``baseline`` on x86-64; ``neon`` on arm64;
one ``native`` path in a ``FLASHATTN_NATIVE=ON`` build) and the best one this
CPU supports is chosen at first use. ``FLASHATTN_CPU_ISA=<name>`` forces one."""

from __future__ import annotations

from . import _core

__all__ = ["cpu_isa", "cpu_isas"]


def cpu_isa() -> str:
    """The cpu engine's path in use, e.g. ``'avx512'``.

    Raises ``ValueError`` when ``FLASHATTN_CPU_ISA`` names no path of this
    build and ``RuntimeError`` when it names one this CPU cannot run (the cpu
    engine's calls raise the same).
    """
    return str(_core.cpu_isa())


def cpu_isas(*, compiled: bool = False) -> list[str]:
    """The paths this CPU can run, best first; with ``compiled=True``, every
    path built into this binary, whether or not this CPU runs it."""
    names = _core.cpu_isas_compiled() if compiled else _core.cpu_isas_supported()
    return [str(n) for n in names]
