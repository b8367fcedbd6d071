"""The metal engine's self-test (core/selftest.h), run here on metal-sim,
which runs the same code when FLASHATTN_METAL_SELFTEST=1: the lane probe and
each pipeline's known-answer call pass on the layout the kernels assume; a
planted wrong lane map (FLASHATTN_SIM_LANE_FAULT=1, or set after start)
fails them, which leaves the engine out of fa.backends() with a warning and
an entry in `python -m flashattn info`; FLASHATTN_METAL_SELFTEST=0 turns it
off (and then the planted fault answers wrong, unseen)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from flashattn import _core

CALLS = textwrap.dedent("""
    import warnings
    import numpy as np
    import flashattn as fa
    from flashattn import _core
    from flashattn.cli import info as _info
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 40, 2, 64), dtype=np.float32)
    k = rng.standard_normal((1, 40, 1, 64), dtype=np.float32)
    do = rng.standard_normal(q.shape, dtype=np.float32)
    def calls():
        o, lse = fa.attention(q, k, k, causal=True, return_lse=True, backend="metal-sim")
        grads = fa.attention_backward(do, q, k, k, o, lse, causal=True, backend="metal-sim")
        ref = fa.attention(q, k, k, causal=True, backend="cpu")
        return float(np.abs(o - ref).max())
""")


def run(script, **env):
    """Runs script in a fresh interpreter with env added; (exit status, output)."""
    full = dict(os.environ, PYTHONWARNINGS="always", **env)
    r = subprocess.run([sys.executable, "-c", CALLS + textwrap.dedent(script)], env=full,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def test_lane_probe_passes_and_a_planted_layout_fails_it():
    assert _core._sim_lane_probe() == ""
    _core._sim_set_lane_fault(True)
    try:
        error = _core._sim_lane_probe()
    finally:
        _core._sim_set_lane_fault(False)
    assert "lane probe: simdgroup_load: lane 0 element 0 holds 3" in error
    assert _core._sim_lane_probe() == ""


def test_selftest_passes_on_metal_sim_and_counts_pipelines():
    status, out = run("""
        err = calls()
        assert err < 1e-5, err
        assert "metal-sim" in fa.backends()
        stats = _core._selftest_stats("metal-sim")
        print("stats", stats)
        assert stats["pipelines"] == 4 and stats["probes"] == 2, stats  # fwd; preprocess, dq, dkdv
        calls()
        assert _core._selftest_stats("metal-sim")["probes"] == 2  # each pipeline tested once
        _info.main([])
    """, FLASHATTN_METAL_SELFTEST="1")
    assert status == 0, out
    assert "metal-sim self-test: 4 pipelines passed in 2 known-answer calls" in out
    assert "RuntimeWarning" not in out


def test_planted_lane_map_at_start_keeps_the_engine_out():
    status, out = run("""
        assert fa.backends() == ["cpu"], fa.backends()
        try:
            fa.attention(q, k, k, backend="metal-sim")
        except ValueError as e:
            print("refused:", e)
        _info.main([])
    """, FLASHATTN_METAL_SELFTEST="1", FLASHATTN_SIM_LANE_FAULT="1")
    assert status == 0, out
    assert "RuntimeWarning: flashattn engine unavailable, 'metal-sim' left out of backends()" in out
    assert "refused: attention: backend 'metal-sim' is not available here (metal-sim engine " \
           "self-test failed: lane probe" in out
    assert "engine left out: metal-sim: metal-sim engine self-test failed: lane probe: " \
           "simdgroup_load: lane 0 element 0 holds 3" in out


def test_planted_lane_map_fails_the_first_call_and_leaves_the_engine_out():
    status, out = run("""
        _core._sim_set_lane_fault(True)  # after the engine started: its lane probe passed
        try:
            calls()
        except RuntimeError as e:
            print("raised:", e)
        assert fa.backends() == ["cpu"], fa.backends()
        _info.main([])
    """, FLASHATTN_METAL_SELFTEST="1")
    assert status == 0, out
    failure = ("metal-sim engine self-test failed: pipeline 'flash_fwd_f32_hd64|0:0=1|1:0=1|2:1=0|3:0=0' "
               "(forward of the tiled probe call B=1 Tq=37 Tk=45 H=2 Hkv=1 D=64 float32 causal)")
    assert "raised: " + failure in out
    assert "RuntimeWarning: flashattn engine unavailable, 'metal-sim' left out of backends(). " \
           "Reason: " + failure in out
    assert "engine left out: metal-sim: " + failure in out


def test_selftest_off_lets_the_planted_fault_answer_wrong():
    status, out = run("""
        assert fa.backends() == ["cpu", "metal-sim"], fa.backends()
        assert _core._selftest_stats("metal-sim") is None
        print("error", calls())
    """, FLASHATTN_METAL_SELFTEST="0", FLASHATTN_SIM_LANE_FAULT="1")
    assert status == 0, out
    assert float(out.split("error ")[1].split()[0]) > 0.01, out


def test_a_varlen_call_checks_its_pipelines_with_a_varlen_probe():
    """A one-launch varlen call plans pipelines of its own (FA_FC_VARLEN):
    their first use runs the varlen probe call, and a planted fault there
    leaves the engine out, naming the varlen pipeline and probe."""
    status, out = run("""
        calls()                                   # the dense pipelines: 4, in 2 probe calls
        cu = np.array([0, 5, 5, 40], dtype=np.int32)
        qv, kv = q[0], k[0]                       # (40, 2, 64), (40, 1, 64): 3 sequences
        o, lse = fa.attention_varlen(qv, kv, kv, cu, cu, causal=True, return_lse=True,
                                     backend="metal-sim")
        ref = fa.attention_varlen(qv, kv, kv, cu, cu, causal=True, backend="cpu")
        assert np.abs(o - ref).max() < 1e-5
        stats = _core._selftest_stats("metal-sim")
        assert stats["pipelines"] == 5 and stats["probes"] == 3, stats   # and the varlen forward
        _core._sim_set_lane_fault(True)
        try:
            fa.attention_varlen_backward(do[0], qv, kv, kv, o, lse, cu, cu, causal=True,
                                         backend="metal-sim")
        except RuntimeError as e:
            print("raised:", e)
        assert fa.backends() == ["cpu"], fa.backends()
    """, FLASHATTN_METAL_SELFTEST="1")
    assert status == 0, out
    assert "raised: metal-sim engine self-test failed: pipeline 'flash_bwd_dq_f32_hd64|" in out
    assert "3:0=1' (backward of the varlen probe call B=1 Tq=50 Tk=81 H=2 Hkv=1 D=64 float32 " \
           "causal, sequences of 37x45, 1x30, 0x6, 12x0)" in out
