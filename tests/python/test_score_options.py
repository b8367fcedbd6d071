"""The score options of issue 16 (softcap, alibi_slopes, mask, sinks) on every
engine, forward and backward, against the float64 reference by the rule of
helpers.assert_close_to_reference: one grid over the options, alone and
combined, crossed with causal, window, GQA/MQA and Tq != Tk; then the mask's
layouts (broadcast, strided, fully hidden rows and tiles) and the errors."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn as fa
from helpers import FORWARD_FACTOR, GRADIENT_FACTOR, Case, _max_abs, assert_close_to_reference, inputs

# Every engine applies every option (the metal engine's kernels are
# metal-sim's, and its host stages the options' arrays: tests/cpp/
# test_metal_host_sim.cpp runs that host under metal-sim). An engine that did
# not would refuse them naming each one: tests/cpp/test_engine.cpp.

CASES = [
    Case(2, 13, 29, 6, 2, 59),                        # GQA, Tq < Tk
    Case(2, 29, 13, 4, 4, 64, causal=True),           # Tq > Tk: rows that see no key
    Case(1, 113, 203, 4, 1, 64, causal=True, window=(15, 0)),  # MQA, a window band
    Case(2, 64, 64, 4, 2, 32, window=(17, 9)),
    Case(1, 1, 203, 8, 2, 64),                        # decode
    Case(1, 130, 150, 2, 2, 111, causal=True),        # several tiles, awkward D
]

# name -> the options, given the case and a seeded generator.
def _slopes_h(c, rng):
    return dict(alibi_slopes=rng.uniform(0.02, 0.3, c.H).astype(np.float32))


def _slopes_bh(c, rng):
    return dict(alibi_slopes=rng.uniform(0.02, 0.3, (c.B, c.H)).astype(np.float32))


def _mask_bool(c, rng):  # one mask for every head: broadcast along H
    return dict(mask=rng.random((c.B, 1, c.Tq, c.Tk)) < 0.6)


def _mask_float(c, rng):
    m = rng.standard_normal((c.Tq, c.Tk)).astype(np.float32)
    m[rng.random(m.shape) < 0.25] = -np.inf
    return dict(mask=m)


def _sinks(c, rng):
    return dict(sinks=rng.standard_normal(c.H).astype(np.float32))


def _everything(c, rng):
    return dict(softcap=4.0, **_slopes_bh(c, rng), **_mask_bool(c, rng), **_sinks(c, rng))


OPTIONS = {
    "softcap": lambda c, rng: dict(softcap=2.5),
    "softcap-large": lambda c, rng: dict(softcap=30.0),
    "alibi-H": _slopes_h,
    "alibi-BH": _slopes_bh,
    "mask-bool": _mask_bool,
    "mask-float": _mask_float,
    "sinks": _sinks,
    "sinks-dominant": lambda c, rng: dict(sinks=np.full(c.H, 6.0, np.float32)),
    "softcap+alibi": lambda c, rng: dict(softcap=1.5, **_slopes_h(c, rng)),
    "mask-float+sinks": lambda c, rng: dict(**_mask_float(c, rng), **_sinks(c, rng)),
    "everything": _everything,
}


def options_for(name, case, seed=0):
    return OPTIONS[name](case, np.random.default_rng(seed))


def check_forward(backend, case, q, k, v, options):
    opts = dict(case.opts(), **options)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **opts)
    o64, lse64 = fa.reference.attention(q, k, v, return_lse=True, **opts)
    o32, lse32 = fa.reference.attention(q, k, v, return_lse=True, dtype=np.float32, **opts)
    assert lse.shape == (case.B, case.H, case.Tq)
    assert_close_to_reference(o, o64, o32, factor=FORWARD_FACTOR, backend=backend, name="o",
                              dtype=q.dtype)
    assert_close_to_reference(lse, lse64, lse32, factor=FORWARD_FACTOR, backend=backend, name="lse",
                              dtype=q.dtype, out_dtype=np.float32)
    return o, lse


def check_backward(backend, case, q, k, v, do, options):
    opts = dict(case.opts(), **options)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **opts)
    grads = fa.attention_backward(do, q, k, v, o, lse, backend=backend, **opts)
    refs = fa.reference.attention_backward(do, q, k, v, **opts)
    # The yardstick reads the o the engine reads (helpers.check_backward).
    bases = fa.reference.attention_backward(do, q, k, v, o, lse, dtype=np.float32,
                                            delta_from_o=True, **opts)
    names = ("dq", "dk", "dv", "dsinks")[:len(refs)]
    assert len(grads) == len(refs) == (4 if "sinks" in options else 3)
    magnitude = max(_max_abs(r) for r in refs[:3])
    for name, got, ref, base in zip(names, grads, refs, bases):
        assert got.shape == ref.shape, f"{name}: shape {got.shape}, want {ref.shape}"
        assert_close_to_reference(got, ref, base, factor=GRADIENT_FACTOR, backend=backend,
                                  name=name, magnitude=None if name == "dsinks" else magnitude,
                                  dtype=q.dtype,
                                  out_dtype=np.float32 if name == "dsinks" else q.dtype)
    return grads


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_with_options_matches_reference(backend, case, option, dtype):
    q, k, v, _ = inputs(case, seed=40, dtype=dtype)
    check_forward(backend, case, q, k, v, options_for(option, case, 41))


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_backward_with_options_matches_reference(backend, case, option, dtype):
    q, k, v, do = inputs(case, seed=42, dtype=dtype)
    check_backward(backend, case, q, k, v, do, options_for(option, case, 43))


# ---- The mask's layouts: read in place through its strides, never expanded.

BIG = Case(1, 150, 200, 2, 1, 64, causal=False)


def test_mask_broadcast_and_strided_layouts_agree(backend):
    """A (Tk,) mask, a (1, H, 1, Tk) one, a transposed (strided) one and
    their dense (B, H, Tq, Tk) copies give the same outputs bit for bit."""
    case = Case(2, 37, 45, 4, 2, 32, causal=True)
    q, k, v, do = inputs(case, seed=44)
    rng = np.random.default_rng(45)
    masks = [
        rng.random(case.Tk) < 0.7,
        rng.random((1, case.H, 1, case.Tk)) < 0.7,
        np.ascontiguousarray((rng.random((case.Tk, case.Tq)) < 0.7)).T,  # strides (1, Tq)
        rng.standard_normal((case.B, 1, case.Tq, 1)).astype(np.float32),
    ]
    for mask in masks:
        dense = np.ascontiguousarray(np.broadcast_to(mask, (case.B, case.H, case.Tq, case.Tk)))
        got = check_backward(backend, case, q, k, v, do, dict(mask=mask))
        want = fa.attention_backward(do, q, k, v, *fa.attention(q, k, v, causal=True, mask=dense,
                                                                return_lse=True, backend=backend),
                                     causal=True, mask=dense, backend=backend)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_mask_hiding_rows_and_whole_tiles(backend):
    """Rows whose keys the mask hides all get o = 0, lse = -inf and no
    gradient (lse = the sink with sinks); key blocks it hides wholly (64 keys
    from 64 on, every row) are skipped and get zero dk, dv."""
    case = BIG
    q, k, v, do = inputs(case, seed=46)
    mask = np.random.default_rng(47).random((case.Tq, case.Tk)) < 0.5
    mask[:, 64:128] = False
    mask[[3, 77, 149]] = False
    o, lse = check_forward(backend, case, q, k, v, dict(mask=mask))
    assert np.all(o[:, [3, 77, 149]] == 0) and np.all(np.isneginf(lse[:, :, [3, 77, 149]]))
    dq, dk, dv = check_backward(backend, case, q, k, v, do, dict(mask=mask))
    assert np.all(dq[:, [3, 77, 149]] == 0)
    assert np.all(dk[:, 64:128] == 0) and np.all(dv[:, 64:128] == 0)
    sinks = np.array([0.25, -np.inf], np.float32)
    o, lse = check_forward(backend, case, q, k, v, dict(mask=mask, sinks=sinks))
    assert np.all(o[:, [3, 77, 149]] == 0)
    assert np.all(lse[:, 0, [3, 77, 149]] == np.float32(0.25))
    assert np.all(np.isneginf(lse[:, 1, [3, 77, 149]]))


def test_key_blocks_the_mask_hides_are_skipped(backend):
    """A key block the mask hides from every row is never read: NaN in its K
    and V rows (which 0 * NaN would spread, were the block computed with
    zero weights) leaves o, lse and every gradient as they are with those
    rows finite, forward and backward, bool and float masks alike."""
    case = BIG
    q, k, v, do = inputs(case, seed=49)
    keep = np.random.default_rng(50).random((case.Tq, case.Tk)) < 0.5
    keep[:, 64:128] = False
    for mask in [keep, np.where(keep, np.float32(0.0), np.float32(-np.inf))]:
        kn, vn = k.copy(), v.copy()
        kn[:, 64:128] = np.nan
        vn[:, 64:128] = np.nan
        o, lse = fa.attention(q, k, v, mask=mask, return_lse=True, backend=backend, **case.opts())
        on, lsen = fa.attention(q, kn, vn, mask=mask, return_lse=True, backend=backend,
                                **case.opts())
        np.testing.assert_array_equal(on, o)
        np.testing.assert_array_equal(lsen, lse)
        grads = fa.attention_backward(do, q, k, v, o, lse, mask=mask, backend=backend,
                                      **case.opts())
        grads_n = fa.attention_backward(do, q, kn, vn, o, lse, mask=mask, backend=backend,
                                        **case.opts())
        for g, gn in zip(grads, grads_n):
            assert np.isfinite(gn).all()
            np.testing.assert_array_equal(gn, g)


def test_options_that_change_nothing(backend):
    """softcap=0, zero slopes, an all-true mask, a zero float mask and sinks
    of -inf are plain attention, bit for bit."""
    case = Case(2, 33, 47, 4, 2, 40, causal=True, window=(20, 0))
    q, k, v, do = inputs(case, seed=48)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **case.opts())
    for options in [dict(softcap=0.0), dict(mask=np.ones((1, 1), bool)),
                    dict(mask=np.zeros(case.Tk, np.float32)),
                    dict(alibi_slopes=np.zeros(case.H, np.float32)),
                    dict(sinks=np.full(case.H, -np.inf, np.float32))]:
        o2, lse2 = fa.attention(q, k, v, return_lse=True, backend=backend, **case.opts(), **options)
        np.testing.assert_array_equal(o2, o, err_msg=str(options))
        np.testing.assert_array_equal(lse2, lse, err_msg=str(options))


# ---- Errors name the argument and the value.

@pytest.mark.parametrize("kwargs,error,message", [
    (dict(softcap=-1.0), ValueError, "softcap must be 0 .off. or positive"),
    (dict(softcap=float("nan")), ValueError, "softcap must be 0"),
    (dict(softcap="1"), TypeError, "softcap must be a real number"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must have shape \(H,\) = \(2,\)"),
    (dict(alibi_slopes=np.ones(2)), TypeError, "alibi_slopes must be float32"),  # not the reference's
    (dict(alibi_slopes=[0.1, 0.2]), TypeError, "alibi_slopes must be a float32 numpy.ndarray"),
    (dict(mask=np.ones((5, 7), bool)), ValueError, r"mask must be broadcastable to \(B, H, Tq, Tk\) = \(1, 2, 5, 6\), got shape \(5, 7\)"),
    (dict(mask=np.ones((5, 6), np.int32)), TypeError, "mask must be bool .True: may attend. or float32"),
    (dict(sinks=np.ones((1, 2), np.float32)), ValueError, r"sinks must have shape \(H,\) = \(2,\)"),
    (dict(sinks=np.array([0.0, np.nan], np.float32)), ValueError, "sinks must be finite or -inf, got nan for head 1"),
])
def test_bad_options_raise_naming_the_argument(kwargs, error, message):
    case = Case(1, 5, 6, 2, 2, 8)
    q, k, v, do = inputs(case)
    calls = [lambda: fa.attention(q, k, v, **kwargs),
             lambda: fa.attention_backward(do, q, k, v, q, np.zeros((1, 2, 5), np.float32),
                                           **kwargs)]
    float64_slopes = "alibi_slopes" in kwargs and getattr(kwargs["alibi_slopes"], "dtype", None) == np.float64
    if not float64_slopes:  # the reference, the oracle, also takes float64 option arrays
        calls.append(lambda: fa.reference.attention(q, k, v, **kwargs))
    for call in calls:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize("Tq,Tk", [(0, 5), (4, 0)])
def test_empty_calls_with_sinks(backend, Tq, Tk):
    """No rows: empty outputs; no keys: o = 0 and lse = the sink (the only
    logit), dsinks = 0 (o = 0 makes do.o = 0)."""
    case = Case(2, Tq, Tk, 4, 2, 8)
    q, k, v, do = inputs(case, seed=49)
    sinks = np.array([0.5, -1.0, -np.inf, 2.0], np.float32)
    o, lse = fa.attention(q, k, v, sinks=sinks, return_lse=True, backend=backend)
    o64, lse64 = fa.reference.attention(q, k, v, sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(o, o64.astype(np.float32))
    np.testing.assert_array_equal(lse, lse64.astype(np.float32))
    if Tq:
        assert np.all(lse == sinks[None, :, None])
    dq, dk, dv, dsinks = fa.attention_backward(do, q, k, v, o, lse, sinks=sinks, backend=backend)
    assert dsinks.shape == (4,) and np.all(dsinks == 0)
    assert not dq.any() and not dk.any() and not dv.any()


def test_strided_inputs_with_options(backend):
    """q, k, v sliced from one packed qkv array, with every option: the same
    bits as contiguous copies."""
    B, T, H, D = 2, 45, 4, 40
    case = Case(B, T, T, H, H, D, causal=True)
    rng = np.random.default_rng(50)
    qkv = rng.standard_normal((B, T, 3, H, D), dtype=np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    do = rng.standard_normal((B, T, H, D), dtype=np.float32)
    opts = dict(causal=True, **options_for("everything", case, 51))
    check_backward(backend, case, q, k, v, do, {key: opts[key] for key in opts if key != "causal"})
    got = fa.attention(q, k, v, backend=backend, **opts)
    want = fa.attention(*(np.ascontiguousarray(x) for x in (q, k, v)), backend=backend, **opts)
    np.testing.assert_array_equal(got, want)


def test_a_float_mask_of_odd_strides_is_an_error_naming_mask():
    """Issue 32 item 11: a float32 field of a structured array (5-byte
    strides: float32 + bool) as the mask reached the extension, which
    answered with nanobind's signature dump. Now a ValueError names mask,
    the strides and the fix, on every engine and the reference."""
    case = Case(1, 5, 6, 2, 2, 8)
    q, k, v, do = inputs(case, seed=52)
    packed = np.zeros((5, 6), dtype=[("bias", np.float32), ("keep", np.bool_)])
    mask = packed["bias"]
    assert mask.strides == (30, 5)
    message = r"attention\w*: mask must be aligned with strides that are whole float32 elements"
    lse = np.zeros((1, 2, 5), np.float32)
    for backend in fa.backends():
        with pytest.raises(ValueError, match=message):
            fa.attention(q, k, v, mask=mask, backend=backend)
        with pytest.raises(ValueError, match=message):
            fa.attention_backward(do, q, k, v, q, lse, mask=mask, backend=backend)
    with pytest.raises(ValueError, match=message):
        fa.reference.attention(q, k, v, mask=mask)
    # The fix the message gives works, and equals the mask's values read anew.
    fixed = fa.attention(q, k, v, mask=np.ascontiguousarray(mask))
    np.testing.assert_array_equal(fixed, fa.attention(q, k, v, mask=np.zeros((5, 6), np.float32)))


def test_batch_of_zero_with_per_batch_alibi_slopes(backend):
    """Issue 32 item 10: B = 0 with alibi_slopes of shape (B, H) = (0, H)
    raised a spurious ValueError; empty outputs now, as with (H,) slopes."""
    case = Case(0, 5, 6, 4, 2, 8)
    q, k, v, do = inputs(case, seed=53)
    for slopes in (np.ones((0, 4), np.float32), np.ones(4, np.float32)):
        o, lse = fa.attention(q, k, v, alibi_slopes=slopes, return_lse=True, backend=backend)
        assert o.shape == (0, 5, 4, 8) and lse.shape == (0, 4, 5)
        dq, dk, dv = fa.attention_backward(do, q, k, v, o, lse, alibi_slopes=slopes,
                                           backend=backend)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        o64, lse64 = fa.reference.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
        assert o64.shape == o.shape and lse64.shape == lse.shape
        g64 = fa.reference.attention_backward(do, q, k, v, alibi_slopes=slopes)
        assert [g.shape for g in g64] == [q.shape, k.shape, v.shape]
