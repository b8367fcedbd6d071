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


# ---- The score options (issue 16): softcap, ALiBi, mask, sinks; varlen.

def loop_with_options(q, k, v, causal, window, scale, softcap, slopes, mask, sinks):
    """The contract's words, one score at a time: s = scale q.k; softcap:
    s = c tanh(s / c); ALiBi: s -= slope |p - j|; a bool mask hides, a float
    mask adds; the sink is one more logit in the denominator with value 0."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    o = np.zeros((B, Tq, H, D))
    lse = np.full((B, H, Tq), -np.inf)
    for b, h, i in np.ndindex(B, H, Tq):
        g = h // (H // Hkv)
        p = i + Tk - Tq
        s = {}
        for j in range(Tk):
            if not visible(i, j, Tq, Tk, causal, window):
                continue
            x = scale * sum(float(q[b, i, h, d]) * float(k[b, j, g, d]) for d in range(D))
            if softcap:
                x = softcap * math.tanh(x / softcap)
            if slopes is not None:
                x -= float(slopes[b, h]) * abs(p - j)
            if mask is not None and mask.dtype == bool:
                if not mask[b, h, i, j]:
                    continue
            elif mask is not None:
                x += float(mask[b, h, i, j])
            if x != -math.inf:
                s[j] = x
        logits = list(s.values()) + ([float(sinks[h])] if sinks is not None else [])
        logits = [x for x in logits if x != -math.inf]
        if not logits:
            continue
        m = max(logits)
        lse[b, h, i] = m + math.log(sum(math.exp(x - m) for x in logits))
        for j, x in s.items():
            o[b, i, h] += math.exp(x - lse[b, h, i]) * v[b, j, g].astype(np.float64)
    return o, lse


def option_arrays(case, seed, *, slopes=None, mask=None, sinks=False):
    """Seeded option arrays for a case: slopes of shape (H,) or (B, H),
    a mask 'bool' / 'float' of shape (B, 1, Tq, Tk) (broadcast over heads),
    sinks (H,)."""
    rng = np.random.default_rng(seed)
    out = {}
    if slopes == "H":
        out["alibi_slopes"] = rng.uniform(0.05, 0.5, case.H).astype(np.float32)
    elif slopes == "BH":
        out["alibi_slopes"] = rng.uniform(0.05, 0.5, (case.B, case.H)).astype(np.float32)
    if mask == "bool":
        out["mask"] = rng.random((case.B, 1, case.Tq, case.Tk)) < 0.7
    elif mask == "float":
        m = rng.standard_normal((case.B, 1, case.Tq, case.Tk)).astype(np.float32)
        m[rng.random(m.shape) < 0.2] = -np.inf
        out["mask"] = m
    if sinks:
        out["sinks"] = rng.standard_normal(case.H).astype(np.float32)
    return out


OPTION_SETS = [
    dict(softcap=1.5),
    dict(slopes="H"),
    dict(slopes="BH"),
    dict(mask="bool"),
    dict(mask="float"),
    dict(sinks=True),
    dict(softcap=0.8, slopes="BH", mask="bool", sinks=True),
    dict(softcap=3.0, mask="float", sinks=True),
]


def _split(options):
    softcap = options.get("softcap", 0.0)
    return softcap, {key: value for key, value in options.items() if key != "softcap"}


@pytest.mark.parametrize("case", TINY[:6], ids=lambda c: c.id)
@pytest.mark.parametrize("options", OPTION_SETS, ids=str)
def test_reference_options_match_explicit_loop(case, options):
    softcap, arrays = _split(options)
    q, k, v, _ = inputs(case, seed=23)
    extra = option_arrays(case, 24, **arrays)
    o, lse = fa.reference.attention(q, k, v, return_lse=True, softcap=softcap, **case.opts(),
                                    **extra)
    slopes = extra.get("alibi_slopes")
    slopes = None if slopes is None else np.broadcast_to(slopes, (case.B, case.H))
    mask = extra.get("mask")
    mask = None if mask is None else np.broadcast_to(mask, (case.B, case.H, case.Tq, case.Tk))
    o_loop, lse_loop = loop_with_options(q, k, v, case.causal, case.window, 1 / math.sqrt(case.D),
                                         softcap, slopes, mask, extra.get("sinks"))
    np.testing.assert_allclose(o, o_loop, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_loop))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_loop[np.isfinite(lse_loop)], rtol=1e-12)


def test_reference_sinks_put_weight_nowhere():
    """A sink takes probability without adding a value: a row that sees no
    key (causal, Tq > Tk) gets o = 0 and lse = the sink; a sink of -inf is
    no sink."""
    case = Case(1, 6, 3, 2, 1, 4, causal=True)
    q, k, v, _ = inputs(case, seed=25)
    sinks = np.array([0.5, -np.inf], np.float32)
    o, lse = fa.reference.attention(q, k, v, return_lse=True, causal=True, sinks=sinks)
    assert np.all(o[:, :3] == 0) and np.all(lse[:, 0, :3] == np.float64(np.float32(0.5)))
    o0, lse0 = fa.reference.attention(q, k, v, return_lse=True, causal=True)
    np.testing.assert_array_equal(o[:, :, 1], o0[:, :, 1])
    np.testing.assert_array_equal(lse[:, 1], lse0[:, 1])
    np.testing.assert_allclose(lse[:, 0, 3:], np.logaddexp(lse0[:, 0, 3:], 0.5), rtol=1e-14)


def test_reference_fully_masked_rows_give_zero_and_minus_inf():
    case = Case(1, 4, 5, 2, 2, 3)
    q, k, v, do = inputs(case, seed=26)
    mask = np.ones((4, 5), bool)
    mask[2] = False
    o, lse = fa.reference.attention(q, k, v, return_lse=True, mask=mask)
    assert np.all(o[:, 2] == 0) and np.all(np.isneginf(lse[:, :, 2]))
    assert np.isfinite(lse[:, :, [0, 1, 3]]).all()
    dq, dk, dv = fa.reference.attention_backward(do, q, k, v, mask=mask)
    assert np.all(dq[:, 2] == 0)


@pytest.mark.parametrize("options", OPTION_SETS, ids=str)
def test_reference_option_gradients_match_finite_differences(options):
    """d/dx of L = sum(o * do), x in q, k, v and the sinks, by central
    differences in float64 (softcap's tanh and the sinks' denominator included)."""
    case = Case(1, 4, 5, 2, 1, 3, causal=True, window=(3, 0))
    softcap, arrays = _split(options)
    rng = np.random.default_rng(27)
    q, k, v, do = (rng.standard_normal(s) for s in
                   [(1, 4, 2, 3), (1, 5, 1, 3), (1, 5, 1, 3), (1, 4, 2, 3)])
    extra = option_arrays(case, 28, **arrays)
    sinks = extra.pop("sinks", None)
    sinks = None if sinks is None else sinks.astype(np.float64)
    scale = 0.9

    def loss(q_, k_, v_, sinks_):
        o = fa.reference.attention(q_, k_, v_, scale=scale, softcap=softcap, sinks=sinks_,
                                   **case.opts(), **extra)
        return float(np.sum(o * do))

    grads = fa.reference.attention_backward(do, q, k, v, scale=scale, softcap=softcap,
                                            sinks=sinks, **case.opts(), **extra)
    assert len(grads) == (4 if sinks is not None else 3)
    eps = 1e-6
    for which, g in enumerate(grads):
        x = (q, k, v, sinks)[which]
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus = [a if a is None else a.copy() for a in (q, k, v, sinks)]
            minus = [a if a is None else a.copy() for a in (q, k, v, sinks)]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg=f"gradient {which}")


def padded_with_mask(q, k, v, cu_q, cu_k, causal):
    """The varlen call as one padded batch: sequence b in row b, its padding
    and (causal, bottom-right within the sequence) hidden keys masked out."""
    lens_q, lens_k = np.diff(cu_q), np.diff(cu_k)
    B, Tq, Tk = len(lens_q), int(lens_q.max()), int(lens_k.max())
    qp = np.zeros((B, Tq) + q.shape[1:], q.dtype)
    kp, vp = (np.zeros((B, Tk) + k.shape[1:], k.dtype) for _ in range(2))
    mask = np.zeros((B, 1, Tq, Tk), bool)
    for b in range(B):
        qp[b, :lens_q[b]] = q[cu_q[b]:cu_q[b + 1]]
        kp[b, :lens_k[b]] = k[cu_k[b]:cu_k[b + 1]]
        vp[b, :lens_k[b]] = v[cu_k[b]:cu_k[b + 1]]
        i, j = np.arange(lens_q[b])[:, None], np.arange(lens_k[b])[None, :]
        mask[b, 0, :lens_q[b], :lens_k[b]] = (j <= i + lens_k[b] - lens_q[b]) if causal else True
    return qp, kp, vp, mask


@pytest.mark.parametrize("causal", [False, True])
def test_reference_varlen_is_a_padded_batch_with_a_mask(causal):
    rng = np.random.default_rng(29)
    cu_q = np.array([0, 3, 3, 10, 11], np.int32)   # a sequence without queries
    cu_k = np.array([0, 5, 7, 9, 9], np.int32)     # one without keys; Tq > Tk in another
    q = rng.standard_normal((11, 4, 6)).astype(np.float32)
    k, v = (rng.standard_normal((9, 2, 6)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(4).astype(np.float32)
    slopes = rng.uniform(0.1, 0.3, (4, 4)).astype(np.float32)
    o, lse = fa.reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, softcap=2.0,
                                           alibi_slopes=slopes, sinks=sinks, return_lse=True)
    assert o.shape == q.shape and lse.shape == (4, 11)
    qp, kp, vp, mask = padded_with_mask(q, k, v, cu_q, cu_k, causal)
    # ALiBi's distance uses positions within each sequence: p = i + Tk_b - Tq_b.
    for b in range(4):
        rows = slice(cu_q[b], cu_q[b + 1])
        n_q, n_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if n_q == 0:
            continue
        o_b, lse_b = fa.reference.attention(
            qp[b:b + 1, :n_q], kp[b:b + 1, :max(n_k, 0)], vp[b:b + 1, :n_k], causal=causal,
            softcap=2.0, alibi_slopes=slopes[b], sinks=sinks, return_lse=True)
        np.testing.assert_allclose(o[rows], o_b[0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse[:, rows], lse_b[0], rtol=1e-12)
    # Without ALiBi (whose distances the padding would shift), the padded
    # batch with its mask is the same computation.
    o, lse = fa.reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, softcap=2.0,
                                           sinks=sinks, return_lse=True)
    o_p, lse_p = fa.reference.attention(qp, kp, vp, mask=mask, softcap=2.0, sinks=sinks,
                                        return_lse=True)
    for b in range(4):
        n = cu_q[b + 1] - cu_q[b]
        np.testing.assert_allclose(o[cu_q[b]:cu_q[b + 1]], o_p[b, :n], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse[:, cu_q[b]:cu_q[b + 1]], lse_p[b, :, :n], rtol=1e-12)


def test_reference_varlen_gradients_match_finite_differences():
    rng = np.random.default_rng(30)
    cu_q, cu_k = np.array([0, 2, 5], np.int32), np.array([0, 3, 4], np.int32)
    q, do = rng.standard_normal((5, 2, 3)), rng.standard_normal((5, 2, 3))
    k, v = rng.standard_normal((4, 1, 3)), rng.standard_normal((4, 1, 3))
    sinks = rng.standard_normal(2)
    opts = dict(causal=True, softcap=1.2, alibi_slopes=np.array([0.3, 0.1]))

    def loss(q_, k_, v_, s_):
        return float(np.sum(fa.reference.attention_varlen(q_, k_, v_, cu_q, cu_k, sinks=s_,
                                                          **opts) * do))

    grads = fa.reference.attention_varlen_backward(do, q, k, v, None, None, cu_q, cu_k,
                                                   sinks=sinks, **opts)
    eps = 1e-6
    for which, g in enumerate(grads):
        x = (q, k, v, sinks)[which]
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = [a.copy() for a in (q, k, v, sinks)], [a.copy() for a in (q, k, v, sinks)]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg=f"gradient {which}")


@pytest.mark.parametrize("cu,message", [
    (np.array([1, 3, 5], np.int32), r"cu_seqlens_q\[0\] must be 0, got 1"),
    (np.array([0, 3, 2, 5], np.int32), r"cu_seqlens_q\[2\] = 2 < cu_seqlens_q\[1\] = 3"),
    (np.array([0, 3, 4], np.int32), r"cu_seqlens_q\[2\] = 4 must equal the number of rows 5"),
    (np.array([[0, 5]], np.int32), r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
])
def test_reference_varlen_refuses_bad_prefix_sums(cu, message):
    q = np.zeros((5, 2, 3), np.float32)
    with pytest.raises(ValueError, match=message):
        fa.reference.attention_varlen(q, q, q, cu, np.array([0, 2, 5], np.int32)[:cu.shape[-1]])


def test_reference_varlen_takes_int64_prefix_sums_that_fit_int32():
    q = np.zeros((5, 2, 3), np.float32)
    o = fa.reference.attention_varlen(q, q, q, np.array([0, 5], np.int32), np.array([0, 5]))
    assert o.shape == q.shape
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32 .*got float64"):
        fa.reference.attention_varlen(q, q, q, np.array([0, 5], np.int32), np.array([0., 5.]))


@pytest.mark.parametrize("bad", ["nan_q", "inf_q", "nan_k", "inf_score_mask"])
def test_reference_nan_or_inf_scores_make_the_row_nan_as_the_engines_do(bad):
    """Issue 32 item 9: a row with a NaN or +inf score is NaN in o and lse
    (README: "a NaN or +inf score makes its row NaN"), on the reference as on
    every engine; the other rows and a row that sees no key are unchanged.
    The reference gave such rows o = 0 and lse = -inf."""
    q, k, v, _ = inputs(Case(1, 5, 7, 2, 1, 8), seed=11)
    mask = None
    row = 2
    if bad == "nan_q":
        q[0, row, 0, 3] = np.nan
    elif bad == "inf_q":  # q = +inf against positive k[..., 1]: every score +inf
        q[0, row, 0, :] = 0
        q[0, row, 0, 1] = np.inf
        k[0, :, 0, 1] = np.abs(k[0, :, 0, 1]) + 0.1
    elif bad == "nan_k":  # key 0 is seen by every row (not causal): every row of head 0/1
        k[0, 0, 0, 5] = np.nan
        row = slice(None)
    else:  # a float mask of +inf in one place
        mask = np.zeros((1, 2, 5, 7), np.float32)
        mask[0, 0, row, 4] = np.inf
    o_ref, lse_ref = fa.reference.attention(q, k, v, mask=mask, return_lse=True)
    for backend in fa.backends():
        o, lse = fa.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
        np.testing.assert_array_equal(np.isnan(o_ref), np.isnan(o), err_msg=backend)
        np.testing.assert_array_equal(np.isnan(lse_ref), np.isnan(lse), err_msg=backend)
    heads = slice(None) if bad == "nan_k" else 0
    assert np.isnan(o_ref[0, row, heads]).all() and np.isnan(lse_ref[0, heads, row]).all()
    assert np.isfinite(o_ref[0, 3]).all() or bad == "nan_k"
