"""fa.merge_states: attention over a union of key sets, from each set's
(o, lse), exactly as attention over the whole set gives it; stable at any
lse magnitude; rows that see no key in any part give o = 0, lse = -inf."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn as fa
from helpers import FORWARD_FACTOR, Case, assert_close_to_reference, inputs

CUTS = [(0, 7), (7, 30), (30, 61)]


def _parts(q, k, v, cuts, **opts):
    return [fa.attention(q, k[:, a:b], v[:, a:b], return_lse=True, backend="cpu", **opts)
            for a, b in cuts]


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_merge_equals_attention_over_all_keys(heads):
    case = Case(2, 9, 61, *heads, 24)
    q, k, v, _ = inputs(case, seed=4)
    parts = _parts(q, k, v, CUTS)
    o, lse = fa.merge_states([p[0] for p in parts], [p[1] for p in parts])
    o64, lse64 = fa.reference.attention(q, k, v, return_lse=True)
    o32, lse32 = fa.reference.attention(q, k, v, return_lse=True, dtype=np.float32)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert_close_to_reference(o, o64, o32, factor=FORWARD_FACTOR, backend="merge", name="o")
    assert_close_to_reference(lse, lse64, lse32, factor=FORWARD_FACTOR, backend="merge", name="lse")


def test_parts_in_any_order_and_one_part_is_identity():
    case = Case(1, 5, 61, 2, 2, 16)
    q, k, v, _ = inputs(case, seed=5)
    parts = _parts(q, k, v, CUTS)
    o, lse = fa.merge_states([p[0] for p in parts], [p[1] for p in parts])
    o_rev, lse_rev = fa.merge_states([p[0] for p in parts[::-1]], [p[1] for p in parts[::-1]])
    np.testing.assert_allclose(o_rev, o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse_rev, lse, rtol=1e-6, atol=1e-6)
    o1, lse1 = fa.merge_states([parts[0][0]], [parts[0][1]])
    np.testing.assert_allclose(o1, parts[0][0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(lse1, parts[0][1])


@pytest.mark.parametrize("offset", [-1e4, 80.0, 1e4, 3e37])
def test_stable_at_any_lse_magnitude(offset):
    """Every part's lse moved by one offset (as huge scores would move it):
    the weights only see differences, so o is unchanged and nothing
    overflows, even where exp(lse) is far outside float32."""
    case = Case(1, 4, 61, 2, 2, 8)
    q, k, v, _ = inputs(case, seed=6)
    parts = _parts(q, k, v, CUTS)
    o, lse = fa.merge_states([p[0] for p in parts], [p[1] for p in parts])
    off = np.float32(offset)
    # The lse differences must survive the shift in float32 for the test to
    # mean anything: at 3e37 they do not, so shift by exact multiples there.
    shifted = [(p[1].astype(np.float64) + offset).astype(np.float32) for p in parts]
    o2, lse2 = fa.merge_states([p[0] for p in parts], shifted)
    assert np.isfinite(o2).all() and np.isfinite(lse2).all()
    want = [s - off for s in shifted]  # the differences the merge actually saw
    o3, _ = fa.merge_states([p[0] for p in parts], want)
    np.testing.assert_allclose(o2, o3, rtol=1e-5, atol=1e-6)
    if abs(offset) <= 1e4:
        np.testing.assert_allclose(o2, o, rtol=2e-3, atol=2e-3)


def test_parts_without_keys_drop_out():
    """A part over no keys (o = 0, lse = -inf, as attention over zero keys
    gives) adds nothing; rows where every part is such give o = 0, lse = -inf."""
    case = Case(1, 6, 61, 2, 1, 8)
    q, k, v, _ = inputs(case, seed=7)
    (empty_o, empty_lse), (o_all, lse_all) = _parts(q, k, v, [(0, 0), (0, 61)])
    assert (empty_o == 0).all() and np.isneginf(empty_lse).all()
    o, lse = fa.merge_states([empty_o, o_all, empty_o], [empty_lse, lse_all, empty_lse])
    np.testing.assert_allclose(o, o_all, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse, lse_all, rtol=1e-6, atol=1e-6)
    o0, lse0 = fa.merge_states([empty_o, empty_o], [empty_lse, empty_lse])
    assert (o0 == 0).all() and np.isneginf(lse0).all()


def test_nan_reaches_the_row_it_belongs_to():
    case = Case(1, 3, 61, 2, 2, 8)
    q, k, v, _ = inputs(case, seed=8)
    parts = _parts(q, k, v, CUTS)
    lses = [p[1].copy() for p in parts]
    lses[1][0, 1, 2] = np.nan
    o, lse = fa.merge_states([p[0] for p in parts], lses)
    assert np.isnan(lse[0, 1, 2]) and np.isnan(o[0, 2, 1]).all()
    lse[0, 1, 2] = 0
    assert np.isfinite(lse).all()
    o[0, 2, 1] = 0
    assert np.isfinite(o).all()


def test_bad_arguments_name_what_is_wrong():
    case = Case(1, 3, 61, 2, 2, 8)
    q, k, v, _ = inputs(case)
    (o, lse), = _parts(q, k, v, [(0, 61)])
    with pytest.raises(ValueError, match="o_parts is empty"):
        fa.merge_states([], [])
    with pytest.raises(ValueError, match="1 o_parts but 2 lse_parts"):
        fa.merge_states([o], [lse, lse])
    with pytest.raises(TypeError, match=r"lse_parts\[0\] must be float32"):
        fa.merge_states([o], [lse.astype(np.float64)])
    with pytest.raises(ValueError, match=r"lse_parts\[0\] must be \(B, H, Tq\)"):
        fa.merge_states([o], [lse[:, :, :2]])
    with pytest.raises(ValueError, match=r"o_parts\[1\] has shape"):
        fa.merge_states([o, o[:, :2]], [lse, lse])
    with pytest.raises(TypeError, match=r"o_parts\[1\] is float64"):
        fa.merge_states([o, o.astype(np.float64)], [lse, lse])
    with pytest.raises(TypeError, match="sequence of arrays"):
        fa.merge_states(3, [lse])


def test_masked_arrays_and_float64_parts_are_refused_naming_the_argument():
    """Issue 32 item 13: merge_states took a masked array's data and dropped
    its mask without a word, and merged float64 parts, where the NumPy API
    refuses both with a TypeError naming the argument."""
    case = Case(1, 3, 61, 2, 2, 8)
    q, k, v, _ = inputs(case)
    (o1, l1), (o2, l2) = _parts(q, k, v, [(0, 30), (30, 61)])
    hide = np.zeros(o1.shape, bool)
    hide[0, 1] = True
    with pytest.raises(TypeError, match=r"merge_states: o_parts\[1\] is a masked array"):
        fa.merge_states([o1, np.ma.masked_array(o2, hide)], [l1, l2])
    with pytest.raises(TypeError, match=r"merge_states: lse_parts\[0\] is a masked array"):
        fa.merge_states([o1, o2], [np.ma.masked_array(l1, np.isnan(l1)), l2])
    with pytest.raises(TypeError, match=r"merge_states: o_parts is a masked array"):
        fa.merge_states(np.ma.masked_array(np.stack([o1, o2])), [l1, l2])
    with pytest.raises(TypeError, match=r"merge_states: o_parts\[0\] must be float32, float16 "
                                        r"or bfloat16 .*got float64"):
        fa.merge_states([o1.astype(np.float64), o2.astype(np.float64)], [l1, l2])
    with pytest.raises(TypeError, match=r"o_parts\[0\] must be float32, float16 or bfloat16"):
        fa.merge_states([o1.astype(np.int32)], [l1])
