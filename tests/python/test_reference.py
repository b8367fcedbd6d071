"""The oracle itself: fa.reference against a dumb explicit loop written from
the contract's words, its gradients against central finite differences in
float64, and its mask against the rule in flash_params.h."""

from __future__ import annotations

import math

import numpy as np
import pytest

import flashattn as fa
from helpers import Case, inputs

TINY = [
    Case(1, 3, 5, 2, 1, 3),
    Case(2, 4, 4, 2, 2, 2, causal=True),
    Case(1, 6, 3, 4, 2, 3, causal=True),            # Tq > Tk: rows 0..2 see no key
    Case(1, 2, 7, 3, 1, 4, window=(2, 1)),
    Case(1, 5, 5, 2, 1, 2, causal=True, window=(1, 0)),
    Case(1, 7, 4, 2, 2, 3, window=(1, 1)),           # rows 0 and 1 see no key
    Case(1, 3, 9, 1, 1, 5, window=(-1, 0)),
    Case(1, 4, 6, 2, 1, 1, window=(3, -1)),
]


def visible(i, j, Tq, Tk, causal, window):
    """Query i sits at key position p = i + Tk - Tq and sees key j when
    p - left <= j <= p + right (-1: unbounded), and j <= p when causal."""
    p = i + Tk - Tq
    left, right = window
    return ((left == -1 or j >= p - left) and (right == -1 or j <= p + right)
            and (not causal or j <= p))


def loop_attention(q, k, v, causal, window, scale):
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    o = np.zeros((B, Tq, H, D))
    lse = np.full((B, H, Tq), -np.inf)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(Tq):
                keys = [j for j in range(Tk) if visible(i, j, Tq, Tk, causal, window)]
                if not keys:
                    continue
                s = {j: scale * sum(float(q[b, i, h, d]) * float(k[b, j, g, d]) for d in range(D))
                     for j in keys}
                m = max(s.values())
                total = sum(math.exp(s[j] - m) for j in keys)
                lse[b, h, i] = m + math.log(total)
                for j in keys:
                    o[b, i, h] += math.exp(s[j] - lse[b, h, i]) * v[b, j, g].astype(np.float64)
    return o, lse


@pytest.mark.parametrize("case", TINY, ids=lambda c: c.id)
def test_reference_matches_explicit_loop(case):
    q, k, v, _ = inputs(case, seed=20)
    scale = 1 / math.sqrt(case.D)
    o, lse = fa.reference.attention(q, k, v, return_lse=True, **case.opts())
    o_loop, lse_loop = loop_attention(q, k, v, case.causal, case.window, scale)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(o, o_loop, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_loop))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_loop[np.isfinite(lse_loop)], rtol=1e-12)


def test_reference_masked_rows_give_zero_and_minus_inf():
    case = Case(1, 6, 3, 4, 2, 3, causal=True)
    q, k, v, do = inputs(case, seed=21)
    o, lse = fa.reference.attention(q, k, v, return_lse=True, causal=True)
    assert np.all(o[:, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(lse[:, :, 3:]))
    dq, dk, dv = fa.reference.attention_backward(do, q, k, v, causal=True)
    assert np.all(dq[:, :3] == 0)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("case", TINY + [Case(1, 3, 4, 2, 1, 3, causal=True)], ids=lambda c: c.id)
def test_reference_gradients_match_finite_differences(case):
    """d/dx of L = sum(o * do), by central differences in float64."""
    rng = np.random.default_rng(22)
    q, k, v, do = (rng.standard_normal(s) for s in
                   [(case.B, case.Tq, case.H, case.D), (case.B, case.Tk, case.Hkv, case.D),
                    (case.B, case.Tk, case.Hkv, case.D), (case.B, case.Tq, case.H, case.D)])
    scale = 0.7

    def loss(q_, k_, v_):
        return float(np.sum(fa.reference.attention(q_, k_, v_, scale=scale, **case.opts()) * do))

    grads = fa.reference.attention_backward(do, q, k, v, scale=scale, **case.opts())
    eps = 1e-6
    for which, (x, g) in enumerate(zip((q, k, v), grads)):
        assert g.shape == x.shape and g.dtype == np.float64
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args_p = [q.copy(), k.copy(), v.copy()]
            args_m = [q.copy(), k.copy(), v.copy()]
            args_p[which][idx] += eps
            args_m[which][idx] -= eps
            fd[idx] = (loss(*args_p) - loss(*args_m)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg="dq dk dv"[3 * which:3 * which + 2])


def test_reference_float32_mode_is_float32():
    """dtype=np.float32 is the plain unfused float32 implementation the
    tolerance rule measures against: it computes and returns float32."""
    case = Case(1, 5, 7, 2, 1, 8, causal=True)
    q, k, v, do = inputs(case)
    o, lse = fa.reference.attention(q, k, v, return_lse=True, causal=True, dtype=np.float32)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert all(g.dtype == np.float32 for g in
               fa.reference.attention_backward(do, q, k, v, causal=True, dtype=np.float32))
    o64 = fa.reference.attention(q, k, v, causal=True)
    err = np.abs(o - o64).max()
    assert 0 < err < 1e-5  # rounded, but only just


@pytest.mark.parametrize("Tq,Tk", [(1, 1), (1, 9), (9, 1), (5, 8), (8, 5), (7, 7)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (2, -1), (-1, 2), (1, 3), (4, 0)])
def test_visible_keys_is_the_contract_rule(Tq, Tk, causal, window):
    mask = fa.reference.visible_keys(Tq, Tk, causal=causal, window=window)
    want = np.array([[visible(i, j, Tq, Tk, causal, window) for j in range(Tk)] for i in range(Tq)],
                    dtype=bool).reshape(Tq, Tk)
    np.testing.assert_array_equal(mask, want)
