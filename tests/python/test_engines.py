"""One failing engine never takes the others down: every engine this build
could have is either in fa.backends() or listed, with its reason, by
`python -m flashattn`; on a Mac a metallib that cannot be loaded leaves metal
out with a warning naming the paths tried, and the cpu engine keeps working."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import flashattn as fa
from flashattn import _engines
from flashattn.cli import report as _report


def test_cpu_and_metal_sim_are_always_there():
    assert "cpu" in fa.backends() and "metal-sim" in fa.backends()


def test_metal_is_either_there_or_missing_with_a_reason():
    missing = _engines.missing()
    assert ("metal" in fa.backends()) != ("metal" in missing)
    if "metal" in missing:
        reason, _failed = missing["metal"]
        assert reason


def test_python_m_flashattn_says_why_an_engine_is_missing():
    lines = _report.engine_lines()
    assert lines[0] == f"engines on this machine, best first: {', '.join(fa.backends())}"
    for name, (reason, _failed) in _engines.missing().items():
        assert f"not available here: {name}: {reason}" in lines


@pytest.mark.mac
@pytest.mark.skipif(sys.platform != "darwin" or "metal" not in fa.backends(),
                    reason="needs a Mac where the metal engine runs")
def test_a_bad_metallib_leaves_cpu_working(tmp_path):
    bad = tmp_path / "not-a.metallib"
    bad.write_bytes(b"not a metallib")
    env = dict(os.environ, FLASHATTN_METALLIB=str(bad))
    code = (
        "import warnings, numpy as np\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import flashattn as fa\n"
        "print('WARN', [str(x.message) for x in w])\n"
        "print('BACKENDS', fa.backends())\n"
        "q = np.ones((1, 4, 1, 8), np.float32)\n"
        "print('SUM', float(fa.attention(q, q, q, backend='cpu').sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "'metal'" not in out.stdout.split("BACKENDS", 1)[1].splitlines()[0]
    assert "cpu" in out.stdout and "SUM 32.0" in out.stdout
    assert str(bad) in out.stdout  # the warning names the path tried
