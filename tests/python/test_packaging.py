"""What the installed distribution carries: the MIT LICENSE and SPDX
metadata, py.typed and the stubs, and type annotations good enough that
`mypy --strict` accepts a user's script calling the public API."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

import flashattn as fa

PACKAGE = os.path.dirname(fa.__file__)


def test_license_and_metadata():
    dist = metadata.distribution("flashattn")
    meta = dist.metadata
    assert meta["License-Expression"] == "MIT"
    assert any(c.startswith("Programming Language :: Python :: 3.14")
               for c in meta.get_all("Classifier"))
    assert meta["Author"] or meta["Author-email"]
    licenses = [f for f in (dist.files or []) if f.name == "LICENSE"]
    assert licenses, "LICENSE is not in the wheel"
    assert "MIT License" in licenses[0].read_text()


def test_typing_files_are_installed():
    for name in ("py.typed", "_core.pyi", "_api.pyi"):
        assert os.path.isfile(os.path.join(PACKAGE, name)), name


SNIPPET = """
    import numpy as np
    import numpy.typing as npt
    import flashattn as fa

    def step(q: npt.NDArray[np.float32], k: npt.NDArray[np.float32],
             v: npt.NDArray[np.float32]) -> float:
        o, lse = fa.attention(q, k, v, causal=True, return_lse=True)
        o2 = fa.attention(q, k, v, window=(8, 0), backend=fa.backends()[0])
        dq, dk, dv = fa.attention_backward(o, q, k, v, o, lse, causal=True)
        fa.set_num_threads(fa.get_num_threads())
        isa: str = fa.cpu_isa()
        paths: list[str] = fa.cpu_isas(compiled=True)
        return float(dq.sum() + dk.sum() + dv.sum() + o2.sum()) + len(isa) + len(paths)
"""


def test_mypy_strict_accepts_a_user_script(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(SNIPPET))
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental",
                        "--cache-dir", os.devnull, str(script)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict_rejects_a_wrong_call(tmp_path):
    # The check above can fail: a call the annotations forbid is an error.
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")
    script = tmp_path / "wrong.py"
    script.write_text("import flashattn as fa\nx: int = fa.cpu_isa()\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental",
                        "--cache-dir", os.devnull, str(script)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 1 and "Incompatible types" in r.stdout


def _tracked_files(repo: str) -> list:
    """The files git tracks in the source checkout ``repo`` (skips the test
    where there is no such checkout: an installed wheel, an unpacked sdist)."""
    if not os.path.isfile(os.path.join(repo, "pyproject.toml")):
        pytest.skip(f"no source tree at {repo}")
    try:
        r = subprocess.run(["git", "-C", repo, "ls-files", "-z"], capture_output=True,
                           text=True, timeout=60)
    except OSError:
        pytest.skip("git is not installed")
    if r.returncode != 0 or not r.stdout:
        pytest.skip(f"{repo} is not a git checkout: {r.stderr.strip()}")
    return [f for f in r.stdout.split("\0") if f and os.path.isfile(os.path.join(repo, f))]


def test_the_sdist_is_the_tracked_files_and_small(tmp_path):
    # A checkout set up as the README says: a .venv inside it (here with a
    # stand-in file), and what builds and earlier sdists leave behind. The
    # sdist must hold exactly the tracked files (and PKG-INFO), under 1 MB.
    build = pytest.importorskip("scikit_build_core.build",
                                reason="scikit-build-core is in the test extra")
    import shutil
    import tarfile

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tracked = _tracked_files(repo)
    checkout = tmp_path / "checkout"
    for name in tracked:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(repo, name), checkout / name)
    for junk in (".venv/lib/python3.12/site-packages/numpy/__init__.py", ".venv/bin/python",
                 "venv/bin/python", "build/ctest/CMakeCache.txt", "build/cp312/_core.so",
                 "dist/flashattn-0.0.1.tar.gz", "python/flashattn/__pycache__/_api.pyc"):
        (checkout / junk).parent.mkdir(parents=True, exist_ok=True)
        (checkout / junk).write_bytes(b"\0" * 4096)
    cwd = os.getcwd()
    os.chdir(checkout)  # build_sdist packs the current directory
    try:
        name = build.build_sdist(str(tmp_path / "dist"))
    finally:
        os.chdir(cwd)
    path = tmp_path / "dist" / name
    with tarfile.open(path) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    top = names[0].split("/")[0]
    packed = sorted(n[len(top) + 1:] for n in names)
    assert packed == sorted(tracked + ["PKG-INFO"])
    for member in ("LICENSE", "python/flashattn/py.typed", "python/flashattn/_core.pyi"):
        assert member in packed, member
    assert os.path.getsize(path) < 1_000_000, os.path.getsize(path)
