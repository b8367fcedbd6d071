"""layout="bhtd" (torch's and MLX's (B, H, T, D)) in the NumPy API: the same
numbers as "bthd" on the transposed arrays, read in place, o and the
gradients returned in the caller's layout; any other layout is a ValueError."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn as fa


def _bhtd(x):
    return np.ascontiguousarray(x.swapaxes(1, 2))


def test_bhtd_gives_the_bthd_results_transposed(backend, monkeypatch):
    import flashattn._api as api

    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 13, 6, 24), dtype=np.float32)
    k, v = (rng.standard_normal((2, 29, 2, 24), dtype=np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape, dtype=np.float32)
    mask = rng.random((1, 6, 13, 29)) > 0.3
    sinks = rng.standard_normal(6).astype(np.float32)
    opts = dict(causal=True, window=(9, 0), softcap=3.0, mask=mask, sinks=sinks, backend=backend)
    o, lse = fa.attention(q, k, v, return_lse=True, **opts)
    grads = fa.attention_backward(do, q, k, v, o, lse, **opts)

    def no_copy(x):
        raise AssertionError(f"an input of shape {x.shape}, strides {x.strides} was copied")

    monkeypatch.setattr(api, "_contiguous_copy", no_copy)
    qt, kt, vt, dot = (_bhtd(x) for x in (q, k, v, do))
    o_t, lse_t = fa.attention(qt, kt, vt, return_lse=True, layout="bhtd", **opts)
    assert o_t.shape == qt.shape
    np.testing.assert_array_equal(o_t, _bhtd(o))
    np.testing.assert_array_equal(lse_t, lse)
    grads_t = fa.attention_backward(dot, qt, kt, vt, o_t, lse_t, layout="bhtd", **opts)
    for g_t, g, like in zip(grads_t, grads, (qt, kt, vt, sinks)):
        assert g_t.shape == like.shape
        np.testing.assert_array_equal(g_t, _bhtd(g) if g.ndim == 4 else g)


def test_an_unknown_layout_is_a_value_error():
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"^attention: layout must be one of \('bthd', 'bhtd'\), "
                                         r"got 'bsnd'"):
        fa.attention(q, q, q, layout="bsnd")
    with pytest.raises(ValueError, match=r"^attention_backward: layout must be one of"):
        fa.attention_backward(q, q, q, q, q, np.zeros((1, 2, 4), np.float32), layout=None)
