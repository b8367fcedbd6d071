"""`python -m flashattn bench --dtype bf16|fp16`: a bad dtype is a usage
error, and a run prints ours in the dtype against our float32 (and against
torch in the same dtype when torch is installed), every shape and pass."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashattn.cli.bench import cpu as _bench, dtype as _bench_dtype


def test_an_unknown_dtype_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "flashattn", "bench", "--dtype", "fp8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--dtype" in r.stderr and "fp8" in r.stderr


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_the_table_compares_the_dtype_with_fp32_and_torch(monkeypatch, capsys, name):
    shapes = [(1, 64, 2, 1, 16, True), (1, 48, 2, 2, 8, False)]
    monkeypatch.setattr(_bench, "SHAPES", shapes)
    assert _bench_dtype.main(["--dtype", name, "--repeat", "5", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("1, 64,", "1, 48,"))]
    assert len(rows) == 4, out  # fwd and fwd+bwd of each shape
    assert f"ours {name} against ours fp32, fwd+bwd" in out
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "torch not installed" in out
    else:
        assert f"speedup over torch {name}, fwd " in out and "x torch" in out
