"""Bounded work per command buffer (cpp/core/chunks.h): metal-sim runs the same
schedule of grid pieces the metal host encodes. FLASHATTN_MAX_GROUPS_PER_PIECE
forces tiny pieces (each threadgroup launched on its own, with its origin in
the params); the results must be bit-identical to the uncut call, forward and
backward, causal, windowed and grouped-query alike."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn as fa

pytestmark = pytest.mark.skipif("metal-sim" not in fa.backends(),
                                reason="needs the metal-sim engine")

CASES = [
    # B, Tq, Tk, H, Hkv, D, causal, window
    (2, 130, 77, 4, 2, 32, False, (-1, -1)),
    (1, 150, 150, 3, 1, 17, True, (-1, -1)),
    (2, 70, 129, 2, 2, 64, True, (40, 0)),
]


def _inputs(B, Tq, Tk, H, Hkv, D, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    k = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
    do = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    return q, k, v, do


def _run(q, k, v, do, causal, window):
    o, lse = fa.attention(q, k, v, causal=causal, window=window, return_lse=True,
                          backend="metal-sim")
    grads = fa.attention_backward(do, q, k, v, o, lse, causal=causal, window=window,
                                  backend="metal-sim")
    return (o, lse, *grads)


@pytest.mark.parametrize("pieces", ["1", "2", "5"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])))
def test_cut_grids_give_the_same_bits(monkeypatch, case, pieces):
    *shape, causal, window = case
    q, k, v, do = _inputs(*shape)
    monkeypatch.delenv("FLASHATTN_MAX_GROUPS_PER_PIECE", raising=False)
    whole = _run(q, k, v, do, causal, window)
    monkeypatch.setenv("FLASHATTN_MAX_GROUPS_PER_PIECE", pieces)
    cut = _run(q, k, v, do, causal, window)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), whole, cut):
        assert np.array_equal(a, b), f"{name} differs when grids are cut into pieces of {pieces}"
    # And the uncut result is right, so the comparison is not of two wrong answers.
    ref = fa.attention(q, k, v, causal=causal, window=window, backend="cpu")
    np.testing.assert_allclose(whole[0], ref, atol=1e-4, rtol=1e-4)


def test_a_bad_knob_is_an_error_naming_it(monkeypatch):
    q, k, v, _ = _inputs(1, 8, 8, 1, 1, 8)
    monkeypatch.setenv("FLASHATTN_MAX_GROUPS_PER_PIECE", "none")
    with pytest.raises(ValueError, match="FLASHATTN_MAX_GROUPS_PER_PIECE"):
        fa.attention(q, k, v, backend="metal-sim")
