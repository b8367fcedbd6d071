"""Decoding shapes (few query rows, many keys): the cpu engine packs a kv
head's query heads into one tile and splits the keys across tasks
(split-KV), merging the parts exactly. Checked against the float64
reference by FlashAttention's rule, on every engine, and the split must not
make results depend on the thread count."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn as fa
from helpers import Case, check_backward, check_forward, fits, inputs

# Tk >= 1024 with fewer than 16 tiles: the keys are split (cpp/cpu/forward.cpp).
DECODE = [
    Case(1, 1, 4100, 32, 8, 128),
    Case(1, 4, 2048, 32, 8, 128, causal=True),
    Case(3, 1, 1500, 8, 1, 64),
    Case(1, 16, 1100, 4, 4, 40, causal=True),
    Case(2, 3, 3000, 6, 2, 64, window=(700, 0)),  # some key chunks see no row
    Case(1, 2, 5000, 4, 2, 32, causal=True, window=(50, 0)),  # most chunks are empty
    # MHA: the metal engines' vector decode kernel (flash_decode.metal).
    Case(2, 1, 3000, 8, 8, 128),
    Case(1, 5, 2100, 4, 4, 96, causal=True, window=(300, 0)),
    Case(1, 1, 700, 3, 3, 59),
]


@pytest.mark.parametrize("case", DECODE, ids=lambda c: c.id)
def test_decode_forward_matches_reference(backend, case, dtype):
    """In every dtype: half inputs' rows are converted a step of keys at a
    time for all the kv heads a task carries (cpp/cpu/forward.cpp)."""
    if not fits(backend, case):
        pytest.skip(f"{case.id} is beyond {backend}'s size budget")
    q, k, v, _ = inputs(case, seed=11, dtype=dtype)
    check_forward(backend, case, q, k, v)


@pytest.mark.parametrize("case", DECODE[1::2], ids=lambda c: c.id)
def test_decode_backward_matches_reference(backend, case):
    if not fits(backend, case):
        pytest.skip(f"{case.id} is beyond {backend}'s size budget")
    q, k, v, do = inputs(case, seed=12)
    check_backward(backend, case, q, k, v, do)


def test_split_results_do_not_depend_on_the_thread_count():
    case = DECODE[0]
    q, k, v, _ = inputs(case, seed=13)
    before = fa.get_num_threads()
    try:
        fa.set_num_threads(1)
        o1, lse1 = fa.attention(q, k, v, return_lse=True, backend="cpu")
        fa.set_num_threads(3)
        o3, lse3 = fa.attention(q, k, v, return_lse=True, backend="cpu")
    finally:
        fa.set_num_threads(before)
    np.testing.assert_array_equal(o1, o3)
    np.testing.assert_array_equal(lse1, lse3)


def test_split_keeps_nonfinite_values_in_their_rows():
    """An inf in one key's v reaches exactly the rows that see that key,
    whichever key chunk it falls in."""
    case = Case(1, 2, 3000, 4, 2, 32, causal=True, window=(100, 0))
    q, k, v, _ = inputs(case, seed=14)
    v[0, 2950, 1, 5] = np.inf  # seen by both rows (positions 2998, 2999), kv head 1
    o = fa.attention(q, k, v, backend="cpu", **case.opts())
    bad = ~np.isfinite(o)
    assert bad[0, :, 2:4, 5].all(), "rows of kv head 1 see key 2950"
    bad[0, :, 2:4, 5] = False
    assert not bad.any(), "no other entry may be touched"


def test_mha_decode_keeps_nonfinite_values_in_their_rows(backend):
    """MHA decode (the metal engines' vector kernel, split keys): a NaN in
    the v of a key reaches the rows that see it and no other, whether the
    key is hidden by the window or by the mask."""
    case = Case(1, 2, 3000, 4, 4, 32, causal=True, window=(100, 0))
    if not fits(backend, case):
        pytest.skip(f"{case.id} is beyond {backend}'s size budget")
    q, k, v, _ = inputs(case, seed=16)
    # Rows 0 and 1 sit at keys 2998 and 2999 and see 100 keys back.
    v[0, 2999, 1, 5] = np.nan  # past row 0's band: head 1's row 1 only
    v[0, 2990, 2, 7] = np.nan  # in both bands; the mask hides it from head 2's row 0
    mask = np.ones((1, 4, 2, 3000), bool)
    mask[0, 2, 0, 2990] = False
    o = fa.attention(q, k, v, backend=backend, mask=mask, **case.opts())
    bad = ~np.isfinite(o)
    assert bad[0, 1, 1, 5] and bad[0, 1, 2, 7], "the rows that see a NaN key get NaN"
    bad[0, 1, 1, 5] = bad[0, 1, 2, 7] = False
    assert not bad.any(), "no other entry may be touched"


@pytest.mark.parametrize("case", [Case(1, 2, 3000, 4, 2, 32, causal=True),
                                  Case(1, 2, 3000, 4, 4, 32, causal=True)], ids=lambda c: c.id)
@pytest.mark.parametrize("option", ["sinks", "alibi_slopes", "softcap"])
def test_decode_with_score_options_matches_reference(backend, option, case):
    """Options are per head, so their tiles hold one head each; a split-KV
    call counts a head's sink in one key chunk only (GQA: the tiled kernel;
    MHA: the vector kernel on the metal engines)."""
    from helpers import FORWARD_FACTOR, assert_close_to_reference

    if not fits(backend, case):
        pytest.skip(f"{case.id} is beyond {backend}'s size budget")
    q, k, v, _ = inputs(case, seed=15)
    values = {"sinks": np.array([0.5, -1.0, 2.0, 30.0], np.float32),
              "alibi_slopes": np.array([0.01, 0.02, 0.04, 0.08], np.float32),
              "softcap": 5.0}
    opts = dict(case.opts(), **{option: values[option]})
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **opts)
    o64, lse64 = fa.reference.attention(q, k, v, return_lse=True, **opts)
    o32, lse32 = fa.reference.attention(q, k, v, return_lse=True, dtype=np.float32, **opts)
    assert_close_to_reference(o, o64, o32, factor=FORWARD_FACTOR, backend=backend, name="o")
    assert_close_to_reference(lse, lse64, lse32, factor=FORWARD_FACTOR, backend=backend, name="lse")
