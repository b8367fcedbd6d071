"""The NaN and inf contract (README, "NaN and inf inputs"), forward and
backward: a NaN, +inf or -inf in q, k, v or do reaches only the results it
touches, and every other element is the clean answer. Touched are: a query
row holding one (its o, lse, dq), the rows that see a key holding one, and
the dk, dv of every key a touched row sees. A key a row does not see, cut
off by the causal/window band or hidden by the mask (a False of a bool mask,
a -inf of a float one), never reaches that row, whatever its k and v hold.
Every engine and dtype; small shapes whose masked tiles cross the band's
edge, or which a mask hides element by element."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn as fa
from helpers import FORWARD_FACTOR, GRADIENT_FACTOR, Case, assert_close_to_reference, inputs

BAND = Case(1, 20, 24, 4, 2, 32, causal=True, window=(9, 0))
MASKED = Case(1, 20, 24, 4, 2, 32)  # every row sees every key, but for the mask

# Where the value goes: (b, row or key, head or kv head, column). The band's
# key 12 is seen by some rows and cut off from others; so is the masked case's
# key 12 (the mask below hides it from some rows) and row 13's keys.
POSITIONS = {"q": (0, 13, 1, 5), "do": (0, 13, 1, 5), "k": (0, 12, 1, 3), "v": (0, 12, 0, 7)}


def _mask(case, kind, seed=50):
    """A (Tq, Tk) mask hiding about a third of the scores, none of the
    chosen key's or row's all: a bool mask, or a float mask of finite values
    and -inf."""
    rng = np.random.default_rng(seed)
    hidden = rng.random((case.Tq, case.Tk)) < 0.35
    hidden[:, 0] = False  # every row sees a key
    assert hidden[:, 12].any() and not hidden[:, 12].all()
    assert hidden[13].any() and not hidden[13].all()
    if kind == "bool":
        return ~hidden, hidden
    values = rng.standard_normal((case.Tq, case.Tk)).astype(np.float32)
    values[hidden] = -np.inf
    return values, hidden


def _touched(case, visible, where):
    """Boolean masks of the query rows (B, Tq, H) and keys (B, Tk, Hkv) the
    value at POSITIONS[where] touches: visible is (Tq, Tk), what each row
    sees (band and mask)."""
    b, t, hh, _ = POSITIONS[where]
    group = case.H // case.Hkv
    rows = np.zeros((case.B, case.Tq, case.H), bool)
    if where in ("q", "do"):
        rows[b, t, hh] = True
    else:
        rows[b, visible[:, t], hh * group:(hh + 1) * group] = True
    keys = np.zeros((case.B, case.Tk, case.Hkv), bool)
    for rb, ri, rh in zip(*np.nonzero(rows)):
        keys[rb, visible[ri], rh // group] = True
    return rows, keys


def _assert_clean(backend, name, got, ref64, base32, clean, factor, dtype, out_dtype=None):
    """The clean entries are finite and the clean answer, by the rule."""
    assert np.isfinite(got[clean]).all(), (
        f"{name} ({backend}): {np.count_nonzero(~np.isfinite(got[clean]))} non-finite values "
        f"where the input's NaN or inf cannot reach")
    assert_close_to_reference(got[clean], ref64[clean], base32[clean], factor=factor,
                              backend=backend, name=name, dtype=dtype, out_dtype=out_dtype)


@pytest.mark.parametrize("hidden_by", ["band", "bool mask", "float mask"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["q", "k", "v", "do"])
def test_nonfinite_input_reaches_only_what_it_touches(backend, dtype, where, value, hidden_by):
    case = BAND if hidden_by == "band" else MASKED
    opts = case.opts()
    visible = fa.reference.visible_keys(case.Tq, case.Tk, **opts)
    if hidden_by != "band":
        mask, hidden = _mask(case, hidden_by.split()[0])
        opts["mask"] = mask
        visible = visible & ~hidden
    q, k, v, do = inputs(case, seed=51, dtype=dtype)
    dirty = dict(q=q.copy(), k=k.copy(), v=v.copy(), do=do.copy())
    b, t, hh, d = POSITIONS[where]
    dirty[where][b, t, hh, d] = value
    rows, keys = _touched(case, visible, where)
    assert rows.any() and (~rows).any() and (~keys).any()

    o, lse = fa.attention(dirty["q"], dirty["k"], dirty["v"], return_lse=True, backend=backend,
                          **opts)
    dq, dk, dv = fa.attention_backward(dirty["do"], dirty["q"], dirty["k"], dirty["v"], o, lse,
                                       backend=backend, **opts)
    if np.isnan(value):  # the NaN did get in: the touched rows show it
        assert np.isnan(dq[rows]).any()
        if where != "do":
            assert np.isnan(o[rows]).any()

    # The clean answer of the untouched rows and keys: the clean inputs, with
    # the touched rows' do zeroed (untouched keys are seen by untouched rows
    # only, so their dk, dv do not depend on the touched rows).
    do_clean = do.copy()
    do_clean[rows] = 0
    with np.errstate(all="ignore"):
        o64, lse64 = fa.reference.attention(q, k, v, return_lse=True, **opts)
        o32, lse32 = fa.reference.attention(q, k, v, return_lse=True, dtype=np.float32, **opts)
        g64 = fa.reference.attention_backward(do_clean, q, k, v, **opts)
        g32 = fa.reference.attention_backward(do_clean, q, k, v, o32.astype(q.dtype),
                                              dtype=np.float32, delta_from_o=True, **opts)
    clean_rows = ~rows if where != "do" else np.ones_like(rows)  # do never reaches o, lse
    _assert_clean(backend, "o", o, o64, o32, clean_rows, FORWARD_FACTOR, dtype)
    _assert_clean(backend, "lse", lse.transpose(0, 2, 1), lse64.transpose(0, 2, 1),
                  lse32.transpose(0, 2, 1), clean_rows, FORWARD_FACTOR, dtype, np.float32)
    for name, got, ref, base, clean in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, g32,
                                           (~rows, ~keys, ~keys)):
        _assert_clean(backend, name, got, ref, base, clean, GRADIENT_FACTOR, dtype)
