"""The cpu engine's instruction-set dispatch from Python: fa.cpu_isa() names
the path in use (the best this CPU supports unless FLASHATTN_CPU_ISA forces
one), every supported path passes the reduced grid (cpu_isa_grid.py), and a
bad FLASHATTN_CPU_ISA is an error that names it, never a silent fallback.
The path is fixed at first use, so each forced path runs in a fresh process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

import flashattn as fa

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORTED = fa.cpu_isas()
COMPILED = fa.cpu_isas(compiled=True)


def run_python(isa, *args, **env_vars):
    """python *args in a fresh process with FLASHATTN_CPU_ISA=isa (and env_vars)."""
    env = dict(os.environ, FLASHATTN_CPU_ISA=isa, **env_vars)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_supported_paths_are_the_compiled_ones_this_cpu_runs_in_order():
    assert SUPPORTED and set(SUPPORTED) <= set(COMPILED)
    assert SUPPORTED == [isa for isa in COMPILED if isa in SUPPORTED]
    assert SUPPORTED[-1] == COMPILED[-1]  # baseline / neon / native runs everywhere


def test_the_default_path_is_the_best_supported_one():
    if os.environ.get("FLASHATTN_CPU_ISA"):
        pytest.skip("FLASHATTN_CPU_ISA is set for this session")
    assert fa.cpu_isa() == SUPPORTED[0]


def test_the_dispatched_build_has_every_path_of_its_architecture():
    if COMPILED == ["native"]:
        pytest.skip("a FLASHATTN_NATIVE=ON build has one path")
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        assert COMPILED == ["avx512", "avx2", "baseline"]
    elif machine in ("aarch64", "arm64"):
        assert COMPILED == ["neon"]


@pytest.mark.parametrize("isa", SUPPORTED)
def test_every_supported_path_passes_the_grid(isa):
    r = run_python(isa, os.path.join(HERE, "cpu_isa_grid.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"cpu path: {isa}\n" in r.stdout
    assert r.stdout.rstrip().endswith("ok")


@pytest.mark.skipif("avx512" not in SUPPORTED, reason="AMX is used on the avx512 path only")
def test_the_avx512_path_passes_the_grid_without_amx_too():
    """FLASHATTN_CPU_AMX=0: bfloat16 products go back to the vector units
    (as on a CPU without AMX), and pass the same grid; the default run above
    takes AMX for bfloat16 where the CPU has it."""
    r = run_python("avx512", os.path.join(HERE, "cpu_isa_grid.py"), FLASHATTN_CPU_AMX="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("ok")


def test_an_unknown_path_is_a_value_error_naming_it():
    code = ("import numpy as np, flashattn as fa\n"
            "q = np.ones((1, 4, 1, 8), np.float32)\n"
            "for f in (fa.cpu_isa, lambda: fa.attention(q, q, q, backend='cpu')):\n"
            "    try:\n        f()\n    except ValueError as e:\n        print('ValueError:', e)\n")
    r = run_python("sse9", "-c", code)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("ValueError: FLASHATTN_CPU_ISA='sse9'") and "expected one of" in line


@pytest.mark.parametrize("isa", [i for i in COMPILED if i not in SUPPORTED] or
                         [pytest.param("none", marks=pytest.mark.skip(
                             reason="this CPU runs every compiled path"))])
def test_a_path_this_cpu_cannot_run_is_a_runtime_error(isa):
    code = ("import flashattn as fa\n"
            "try:\n    fa.cpu_isa()\nexcept RuntimeError as e:\n    print('RuntimeError:', e)\n")
    r = run_python(isa, "-c", code)
    assert f"RuntimeError: FLASHATTN_CPU_ISA='{isa}': this CPU cannot run it" in r.stdout


# torch's bfloat16 attention (oneDNN, on AMX where the CPU has it) and ours
# take turns on the same threads: each must find the tiles as it expects.
TORCH_AND_OURS = """
import numpy as np, torch, ml_dtypes, flashattn as fa
torch.manual_seed(0)
q = torch.randn(1, 8, 256, 64).bfloat16()
ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)
x = q.float().permute(0, 2, 1, 3).numpy().astype(ml_dtypes.bfloat16)
ours0 = fa.attention(x, x, x).astype(np.float32)
for _ in range(3):
    again = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.equal(again, ref), "torch's result changed after ours ran"
    ours = fa.attention(x, x, x).astype(np.float32)
    assert np.array_equal(ours, ours0), "our result changed after torch's ran"
assert np.abs(ours0 - ref.float().permute(0, 2, 1, 3).numpy()).max() < 0.05
print("ok")
"""


def test_torch_and_our_bfloat16_attention_take_turns_on_a_thread():
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-c", TORCH_AND_OURS], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("ok")
