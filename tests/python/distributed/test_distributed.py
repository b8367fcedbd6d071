"""flashattn.distributed under real MPI: ``mpiexec -n P`` (P = 1, 2, 3, 4,
on this machine, loopback only) runs tests/python/distributed/ring_worker.py, whose
cases (causal and not, both layouts, uneven and empty shards, GQA/MQA,
windows, Tq != Tk, an explicit scale, the metal-sim engine) are checked
forward and backward against the float64 reference by FlashAttention's rule
and against the single-process result. Then: a rank that raises mid-ring
ends every rank within a bounded time; bad arguments on one rank raise on
all; the module imports without mpi4py and says how to install it.

One mpiexec launch per P runs every case (about a second each)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ring_worker

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ring_worker.py"
RANKS = [1, 2, 3, 4]


def _mpiexec() -> str | None:
    """The mpiexec beside this interpreter (the mpich wheel's, in a venv),
    else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


try:
    import mpi4py  # noqa: F401
    MPI_MISSING = None if _mpiexec() else "no mpiexec found beside the interpreter or on PATH"
except ImportError:
    MPI_MISSING = "mpi4py is not installed: pip install '.[mpi]' (CI installs it)"

needs_mpi = pytest.mark.skipif(MPI_MISSING is not None, reason=str(MPI_MISSING))


def _launch(ranks: int, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """mpiexec -n ranks python ring_worker.py args (see _mpirun)."""
    return _mpirun(ranks, [str(WORKER), *args], timeout=timeout)


def _mpirun(ranks: int, python_args: list, *, timeout: float) -> subprocess.CompletedProcess:
    """mpiexec -n ranks python python_args, killed as a whole (process
    group) if it outlives ``timeout``: then the test fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))  # + helpers.py
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, *python_args]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=HERE, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s (hung?)\n"
                    f"stdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_RESULTS: dict = {}


def _results(ranks: int, tmp_path_factory) -> dict:
    """Every case's record for this rank count: one launch, cached."""
    if ranks not in _RESULTS:
        out = tmp_path_factory.mktemp(f"ring{ranks}") / "records.json"
        r = _launch(ranks, str(out), timeout=300)
        assert r.returncode == 0, f"the ring worker failed with P={ranks}:\n{r.stdout}\n{r.stderr}"
        _RESULTS[ranks] = {rec["case"]: rec for rec in json.loads(out.read_text())}
    return _RESULTS[ranks]


@needs_mpi
@pytest.mark.parametrize("case", ring_worker.CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("ranks", RANKS, ids=lambda p: f"P{p}")
def test_ring_matches_single_process(ranks, case, tmp_path_factory):
    import flashattn as fa

    if case.backend is not None and case.backend not in fa.backends():
        pytest.skip(f"backend {case.backend} is not built here")
    records = _results(ranks, tmp_path_factory)
    assert case.name in records, f"the worker wrote no record for {case.name}"
    rec = records[case.name]
    assert rec["P"] == ranks
    assert set(rec["ratio"]) == {"o", "lse", "dq", "dk", "dv"}
    assert rec["ok"], "\n".join(rec["errors"])
    # The ring adds merges and sums over blocks: a few float32 roundings
    # away from one engine call, never more than the rule above allows.
    worst = max(rec["diff_vs_single"].values())
    assert worst < 1e-4, f"max |ring - single process| = {worst:.3e}"


@needs_mpi
def test_a_rank_that_raises_aborts_every_rank():
    """Rank 1 of 3 raises at its first engine call; without the abort rank
    2 waits for it forever (seen: mpiexec still running after 15 s). With it,
    mpiexec ends within the timeout, non-zero, and stderr names the rank
    and the error."""
    r = _launch(3, "--fail-rank", "1", timeout=60)
    assert r.returncode != 0
    assert "ring_attention: rank 1 of 3 failed inside the ring" in r.stderr
    assert "RuntimeError: injected failure for the abort test" in r.stderr
    assert "aborting the communicator" in r.stderr
    assert "rank 2: finished" not in r.stdout


@needs_mpi
def test_a_bad_argument_on_one_rank_raises_on_every_rank():
    r = _launch(2, "--bad-args", timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"rank {rank} ")]
        assert len(mine) == 4, r.stdout
        dtype, heads, layout, gather = mine
        assert "TypeError: ring_attention (rank 1 of 2): attention: k must be float32" in dtype
        assert ("ValueError: ring_attention: the ranks disagree on B, H, D of q: rank 0 has "
                "(1, 2, 8), rank 1 has (1, 2, 4)") in heads
        assert ("the ranks disagree on layout: rank 0 has 'contiguous', rank 1 has 'zigzag'"
                in layout)
        assert ("ValueError: gather: rank 1 has x_local of shape (1, 8, 2, 4) and dtype <f4, "
                "rank 0 of shape (1, 8, 2, 8)") in gather


@needs_mpi
def test_the_readme_demo_runs():
    """The README's command, smaller: each rank's line, and the error against
    one process under the demo's limit."""
    r = _mpirun(3, ["-m", "flashattn.distributed", "demo", "--seq", "300", "--heads", "4",
                    "--kv-heads", "2", "--dim", "16"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ring attention over 3 rank(s)" in r.stdout
    for rank in range(3):
        assert f"rank   {rank}  rows" in r.stdout and "peak RSS" in r.stdout
    assert "verdict: PASS" in r.stdout, r.stdout


@needs_mpi
def test_torch_ring_attention_is_differentiable():
    """flashattn.torch.ring_attention under mpiexec -n 2 (each rank imports
    torch: seconds): autograd gives exactly flashattn.distributed's
    gradients."""
    pytest.importorskip("torch", reason="torch is in the torch extra (CI installs it)")
    r = _launch(2, "--torch", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("torch rank")]
    assert len(lines) == 2, r.stdout
    for line in lines:
        assert "same as flashattn.distributed: True" in line, line
        assert float(line.rsplit(" ", 1)[1]) < 1e-5, line


def test_imports_without_mpi4py_and_says_how_to_install():
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "import numpy as np\n"
        "from flashattn import distributed as fd\n"
        "x = np.zeros((1, 4, 1, 8), np.float32)\n"
        "try:\n"
        "    fd.ring_attention(x, x, x)\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ImportError: flashattn.distributed needs mpi4py" in r.stdout
    assert "pip install 'flashattn[mpi]'" in r.stdout
