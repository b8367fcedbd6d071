"""pytest wiring: every test that takes ``backend`` runs once per engine of
``fa.backends()`` (engines join by name; ``metal`` carries the ``mac``
marker), simulated engines only get the cases that fit their budget (the
others are deselected, and pytest reports how many), and the session ends with
the worst error ratio seen per engine and output."""

from __future__ import annotations

import pytest

import flashattn as fa
from helpers import FORWARD_FACTOR, GRADIENT_FACTOR, WORST, Case, fits

BACKENDS = fa.backends()


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        params = [
            pytest.param(name, id=name, marks=[pytest.mark.mac] if name == "metal" else [])
            for name in BACKENDS
        ]
        metafunc.parametrize("backend", params)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        params = params.params if params else {}
        case = params.get("case")
        if "backend" in params and isinstance(case, Case) and not fits(params["backend"], case):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def restore_threads():
    """Puts the cpu engine's thread count back after a test that changes it."""
    n = fa.get_num_threads()
    yield n
    fa.set_num_threads(n)


def pytest_terminal_summary(terminalreporter):
    if not WORST:
        return
    tr = terminalreporter
    tr.section("worst error ratio against the float64 reference")
    tr.write_line(
        "engine error / plain float32 NumPy error (floored at 1e-6 x the magnitude of the values); "
        f"limits: {FORWARD_FACTOR:g} for o, lse; {GRADIENT_FACTOR:g} for dq, dk, dv"
    )
    outputs = ("o", "lse", "dq", "dk", "dv")
    for backend in sorted({b for b, _ in WORST}):
        cells = [f"{n} {WORST[(backend, n)]:.2f}" for n in outputs if (backend, n) in WORST]
        tr.write_line(f"  {backend:<10} " + "  ".join(cells))
