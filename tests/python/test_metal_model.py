"""docs/metal.md's cost model (bench/metal_model.py) counts the operations
of the kernels in shaders/: its matrix multiply-accumulates, fragment loads
and barriers per launch must be what metal-sim counts running those kernels
(forward, dQ, dK/dV; hd64 and hd128; float32, float16, bfloat16). A kernel
change that alters the loop (block sizes, column chunks, operands reloaded
or recomputed) fails here until the model follows it."""

from __future__ import annotations

import importlib.util
import io
import pathlib
import sys

import pytest

import flashattn as fa

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _model():
    spec = importlib.util.spec_from_file_location("metal_model", ROOT / "bench" / "metal_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["metal_model"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif("metal-sim" not in fa.backends(), reason="metal-sim not built")
def test_model_counts_are_metal_sims():
    model = _model()
    out = io.StringIO()
    bad = model.check(out=out)
    report = out.getvalue()
    # 3 kinds x 2 head sizes x 3 dtypes x 3 counts, each compared.
    assert report.count("metal-sim") == 54, report
    assert bad == 0, report


def test_model_table_has_every_cell():
    model = _model()
    text = model.table(model.VARIANTS)
    rows = [line for line in text.splitlines()[2:]]
    assert len(rows) == 4 * 2 * 3  # forward, dQ, dK/dV, fwd+bwd; D 64, 128; 3 dtypes
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")[3:]]
        assert len(cells) == 6  # M1, M3, M4 x before, after
        assert all(c.endswith("%") and 0 < float(c[:-1]) <= 100 for c in cells), line
