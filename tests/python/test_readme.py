"""The README is true as written: each ```python block runs as it stands
and prints what the text says (the ring attention one runs under mpiexec in
distributed/test_distributed.py), every link to a file of the repository
resolves, and the README stays short (detail goes to docs/)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from readme import README, ROOT, block_with, python_blocks

pytestmark = pytest.mark.skipif(not README.is_file(), reason=f"no source tree at {ROOT}")


def _run(code: str, tmp_path) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_every_python_block_is_one_of_these():
    # A new block must get a test here (or under mpiexec, for ring attention).
    assert len(python_blocks()) == 3


def test_the_quickstart_prints_what_the_readme_says(tmp_path):
    out = _run(block_with("fa.attention_backward(do, q, k, v, o, lse"), tmp_path).splitlines()
    assert out[0].endswith("(2, 1024, 8, 64) (2, 8, 1024) (2, 1024, 2, 64)"), out
    error = float(out[1].split(":")[1])
    assert 1e-8 < error < 1e-5, out  # "an error of about 1e-6"


def test_the_torch_example_runs(tmp_path):
    pytest.importorskip("torch", reason="the torch example needs torch: pip install '.[torch]'")
    out = _run(block_with("import flashattn.torch as fat"), tmp_path)
    assert out.strip() == "torch.Size([1, 128, 4, 32]) torch.Size([1, 128, 4, 32])"


def test_links_to_files_resolve():
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which is not there"


def test_the_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250
