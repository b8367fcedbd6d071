"""Resident memory does not grow over 10 000 calls: forward, backward, and
the error paths (a shape error, a dtype error, an allocation that fails), so
no output buffer, owner capsule or exception state is left behind. The
simulated engines pay ~20 ms of launch cost per call, so they make 500 calls
with a tolerance still below what one leaked dq or o per call would add."""

from __future__ import annotations

import os

import numpy as np
import pytest

import flashattn as fa
from helpers import SIMULATED

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_resident_memory_does_not_grow(backend):
    rng = np.random.default_rng(50)
    # Each call returns about 20 KiB of outputs: a leaked buffer per call
    # would grow memory by about 200 MiB over the run.
    q = rng.standard_normal((1, 24, 4, 32), dtype=np.float32)
    k = rng.standard_normal((1, 24, 2, 32), dtype=np.float32)
    do = rng.standard_normal(q.shape, dtype=np.float32)
    bad_shape = np.zeros((1, 24, 3, 32), np.float32)     # H % Hkv != 0
    huge = np.broadcast_to(np.ones((1, 1, 1, 256), np.float32), (2**10, 2**20, 2**10, 256))
    huge_k = np.ones((2**10, 1, 1, 256), np.float32)

    def one_round(i):
        o, lse = fa.attention(q, k, k, causal=True, return_lse=True, backend=backend)
        fa.attention_backward(do, q, k, k, o, lse, causal=True, backend=backend)
        if i % 10 == 0:
            with pytest.raises(ValueError):
                fa.attention(q, bad_shape, bad_shape, backend=backend)
            with pytest.raises(TypeError):
                fa.attention(q, k.astype(np.float64), k, backend=backend)
            with pytest.raises(MemoryError):
                fa.attention(huge, huge_k, huge_k, backend=backend)

    rounds, tolerance = (500, 2 * 2**20) if backend in SIMULATED else (10_000, 8 * 2**20)
    assert tolerance < rounds * q.nbytes / 2  # a leaked o or dq per call is caught
    for i in range(200):  # warm-up: pools, caches and allocator arenas settle
        one_round(i)
    before = rss_bytes()
    for i in range(rounds):
        one_round(i)
    grown = rss_bytes() - before
    assert grown < tolerance, f"resident memory grew by {grown / 2**20:.1f} MiB over {rounds} calls"
