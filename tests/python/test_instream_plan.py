"""The in-stream paths plan a call for the GPU the metal engine plans for:
its core count (read from the device) sizes split-KV decode, so MLX's and
torch's launches are the metal engine's (tests/cpp/test_call_plan.cpp checks
the plans equal for the same GpuInfo). Where there is no metal engine the
plan models the smallest Apple GPU, as metal-sim does."""

from __future__ import annotations

import pytest

import flashattn._core as core
from flashattn._instream import call

DECODE = dict(q=call.contiguous((1, 1, 8, 128)), k=call.contiguous((1, 32768, 8, 128)))


def _decode_plan():
    return call.plan("forward", "float32", DECODE["q"], DECODE["k"], DECODE["k"])


def test_the_cores_are_the_metal_engines():
    if core._metal_available() if hasattr(core, "_metal_available") else False:
        assert call.gpu_cores() == core._metal_gpu_cores() >= 1
    else:
        assert call.gpu_cores() is None


def test_a_larger_gpu_gets_more_key_splits(monkeypatch):
    small = _decode_plan() if call.gpu_cores() in (None, 8) else None
    monkeypatch.setattr(call, "gpu_cores", lambda: 8)
    m1 = _decode_plan()
    if small is not None:
        assert small == m1
    monkeypatch.setattr(call, "gpu_cores", lambda: 40)
    max40 = _decode_plan()
    # The merge launch's grid and the split kernel's grid grow with the splits.
    assert max40.launches[0].grid[0] * max40.launches[0].grid[1] * max40.launches[0].grid[2] > \
        m1.launches[0].grid[0] * m1.launches[0].grid[1] * m1.launches[0].grid[2]


def test_gpu_cores_must_be_positive():
    with pytest.raises(ValueError, match="gpu_cores must be at least 1, got 0"):
        core._plan_call("forward", "float32", DECODE["q"], DECODE["k"], DECODE["k"], gpu_cores=0)
