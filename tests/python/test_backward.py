"""The backward pass of every engine against the float64 reference, by
FlashAttention's rule for gradients (helpers.assert_close_to_reference,
factor 3): the same grid as the forward, then memory layouts of do and o, and
the gradient of keys that no query sees."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn as fa
from helpers import GRID, Case, check_backward, inputs


@pytest.mark.parametrize("case", GRID, ids=lambda c: c.id)
def test_backward_matches_reference(backend, case, dtype):
    q, k, v, do = inputs(case, dtype=dtype)
    check_backward(backend, case, q, k, v, do)


@pytest.mark.parametrize("scale", [0.0, -0.3, 0.5])
def test_backward_explicit_scale(backend, scale, dtype):
    case = Case(2, 17, 23, 4, 2, 40, causal=True)
    q, k, v, do = inputs(case, seed=1, dtype=dtype)
    check_backward(backend, case, q, k, v, do, scale=scale)


def test_backward_packed_and_strided_inputs(backend):
    """q, k, v from one packed qkv array, do and o as strided views: same
    gradients as contiguous copies, bit for bit."""
    B, T, H, D = 2, 45, 4, 59
    case = Case(B, T, T, H, H, D, causal=True, window=(11, 0))
    rng = np.random.default_rng(9)
    qkv = rng.standard_normal((B, T, 3, H, D), dtype=np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    do = np.asfortranarray(rng.standard_normal((B, T, H, D), dtype=np.float32))
    check_backward(backend, case, q, k, v, do)

    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **case.opts())
    o_view = np.ascontiguousarray(o.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # heads-major memory
    got = fa.attention_backward(do, q, k, v, o_view, lse, backend=backend, **case.opts())
    contiguous = [np.ascontiguousarray(x) for x in (do, q, k, v, o)]
    want = fa.attention_backward(*contiguous, lse, backend=backend, **case.opts())
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # lse as a strided view (every other float of a wider array) is copied
    # once and gives the same gradients.
    wide = np.zeros(lse.shape[:-1] + (2 * lse.shape[-1],), np.float32)
    wide[..., ::2] = lse
    got = fa.attention_backward(do, q, k, v, o, wide[..., ::2], backend=backend, **case.opts())
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_unseen_keys_get_zero_gradient(backend):
    """window (1, 0): query i sees keys p - 1 and p (p = i + Tk - Tq = i + 7);
    keys 0..5 are seen by no query and get exactly zero dk and dv."""
    case = Case(1, 3, 10, 2, 1, 16, window=(1, 0))
    q, k, v, do = inputs(case, seed=10)
    dq, dk, dv = check_backward(backend, case, q, k, v, do)
    assert np.all(dk[:, :6] == 0) and np.all(dv[:, :6] == 0)
    assert np.all(dk[:, 6:] != 0) and np.all(dv[:, 6:] != 0)


def test_gqa_gradients_sum_over_the_group(backend):
    """dk, dv of a shared kv head equal the sums over the query heads of the
    same computation with that kv head repeated (MHA)."""
    case = Case(2, 21, 34, 6, 2, 32, causal=True)
    q, k, v, do = inputs(case, seed=11)
    dq, dk, dv = check_backward(backend, case, q, k, v, do)
    k_rep, v_rep = np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2)
    o, lse = fa.attention(q, k_rep, v_rep, causal=True, return_lse=True, backend=backend)
    dq_m, dk_m, dv_m = fa.attention_backward(do, q, k_rep, v_rep, o, lse, causal=True, backend=backend)
    np.testing.assert_allclose(dq, dq_m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk, dk_m.reshape(2, 34, 2, 3, 32).sum(axis=3), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv, dv_m.reshape(2, 34, 2, 3, 32).sum(axis=3), rtol=1e-5, atol=1e-5)
