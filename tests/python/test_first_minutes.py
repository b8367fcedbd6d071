"""A new user's first minutes (issue 33, section 3): ``import flashattn``
loads no heavy dependency (ml_dtypes, a framework, MPI), a wrapper imported
without its framework says which extra to install, and cu_seqlens in int64
(what np.cumsum gives) is taken when its values fit int32."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import flashattn as fa

HEAVY = ("ml_dtypes", "torch", "jax", "mlx", "mpi4py")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_import_flashattn_loads_no_heavy_dependency():
    # ml_dtypes alone took 1.1 s of the 1.25-1.8 s import before issue 33.
    out = _run(f"import sys, flashattn; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bfloat16_works_when_ml_dtypes_comes_after_flashattn():
    out = _run("import flashattn as fa, numpy as np, ml_dtypes\n"
               "q = np.ones((1, 3, 2, 8), ml_dtypes.bfloat16)\n"
               "print(fa.attention(q, q, q).dtype)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "bfloat16"


def test_cu_seqlens_from_np_cumsum_are_taken_when_they_fit_int32():
    rng = np.random.default_rng(3)
    lengths = np.array([5, 0, 11])
    cu = np.concatenate([[0], np.cumsum(lengths)])  # int64, as np.cumsum gives
    assert cu.dtype == np.int64
    q, k, v = (rng.standard_normal((16, 2, 8), dtype=np.float32) for _ in range(3))
    o, lse = fa.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    want, want_lse = fa.attention_varlen(q, k, v, cu.astype(np.int32), cu.astype(np.int32),
                                         causal=True, return_lse=True)
    np.testing.assert_array_equal(o, want)
    grads = fa.attention_varlen_backward(q, q, k, v, o, lse, cu, cu.astype(np.uint64), causal=True)
    for g, w in zip(grads, fa.attention_varlen_backward(q, q, k, v, o, lse, cu.astype(np.int32),
                                                        cu.astype(np.int32), causal=True)):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must fit int32, got values from 0 to "
                                         r"2147483664"):
        fa.attention_varlen(q, k, v, cu + np.array([0, 0, 0, 2**31]), cu)


@pytest.mark.parametrize("module,framework,extra", [
    ("flashattn.torch", "torch", "torch"), ("flashattn.jax", "jax", "jax"),
    ("flashattn.mlx", "mlx", "mlx")])
def test_a_wrapper_without_its_framework_says_which_extra_to_install(module, framework, extra):
    out = _run(f"import sys; sys.modules[{framework!r}] = None\nimport {module}")
    assert out.returncode == 1
    assert (f"ModuleNotFoundError: {module} needs {framework}, which is not installed: "
            f"pip install 'flashattn[{extra}]'") in out.stderr


def test_the_ring_command_without_mpi4py_says_how_to_install_it_in_one_line():
    out = _run("import sys, runpy; sys.modules['mpi4py'] = None; sys.argv = ['x', 'demo']\n"
               "runpy.run_module('flashattn.distributed', run_name='__main__')")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("python -m flashattn.distributed: flashattn.distributed needs "
                               "mpi4py and an MPI library: pip install 'flashattn[mpi]'")
