"""float16 and bfloat16 (issue 15): which dtypes a call takes and gives, how
they mix (they do not), and the conversions at the tiles' edges: every
finite half value read exactly, results rounded once to nearest even."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flashattn as fa
from flashattn import _core
from helpers import DTYPES, Case, check_backward, check_forward, inputs

HALF = {name: d for name, d in DTYPES.items() if name != "f32"}


def _takes(backend, dtype) -> bool:
    return np.dtype(dtype).name in _core._engine_dtypes(backend)


def _need(backend, dtype):
    if not _takes(backend, dtype):
        pytest.skip(f"the {backend} engine does not take {np.dtype(dtype).name} yet")


def _finite_values(dtype) -> np.ndarray:
    """Every finite value of a 16-bit dtype, once (subnormals included), but
    -0: o sums from +0, so a -0 value comes out +0 (as in float32)."""
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(dtype)
    return x[np.isfinite(x.astype(np.float32)) & (bits != 0x8000)]


@pytest.mark.parametrize("name", list(HALF))
def test_every_finite_value_is_read_and_written_exactly(backend, name):
    """One key per row: o = v bit for bit, so each value goes in through the
    loads (vector and scalar tails: D = 61) and out through the rounding."""
    dtype = HALF[name]
    _need(backend, dtype)
    values = _finite_values(dtype)
    D = 61
    H = -(-values.size // D)
    v = np.resize(values, H * D).reshape(1, 1, H, D)
    q = np.zeros((1, 1, H, D), dtype)
    k = np.zeros((1, 1, H, D), dtype)
    o = fa.attention(q, k, v, backend=backend)
    assert o.dtype == dtype
    np.testing.assert_array_equal(o.view(np.uint16), v.view(np.uint16))


@pytest.mark.parametrize("name", list(HALF))
def test_results_are_rounded_once_to_nearest_even(backend, name):
    """Two keys with equal scores: o = (v0 + v1) / 2, exact in float32, then
    rounded to the dtype; ties (odd sums of neighbours) must go to even,
    as NumPy's and ml_dtypes' casts round."""
    dtype = HALF[name]
    _need(backend, dtype)
    rng = np.random.default_rng(5)
    H, D = 8, 64
    base = rng.standard_normal((1, 1, H, D)).astype(dtype)
    up = np.nextafter(base.astype(np.float32), np.float32(np.inf)).astype(dtype)
    up = np.where(up == base, (base.view(np.uint16) + 1).view(dtype), up)  # one ulp up
    v = np.concatenate([base, up], axis=1)  # the midpoint of neighbours: a tie
    v[0, 1, :2] = rng.standard_normal((2, D)).astype(dtype)  # and some ordinary sums
    q = np.zeros((1, 1, H, D), dtype)
    k = np.zeros((1, 2, H, D), dtype)
    o = fa.attention(q, k, v, backend=backend)
    want = ((v[:, 0].astype(np.float32) + v[:, 1].astype(np.float32)) / 2).astype(dtype)
    np.testing.assert_array_equal(o[:, 0].view(np.uint16), want.view(np.uint16))


def test_outputs_come_in_the_input_dtype_and_lse_in_float32(backend, dtype):
    _need(backend, dtype)
    case = Case(1, 9, 11, 4, 2, 24, causal=True)
    q, k, v, do = inputs(case, seed=3, dtype=dtype)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, causal=True)
    assert o.dtype == dtype and lse.dtype == np.float32
    grads = fa.attention_backward(do, q, k, v, o, lse, backend=backend, causal=True)
    assert [g.dtype for g in grads] == [dtype] * 3


def test_varlen_in_every_dtype(backend, dtype):
    _need(backend, dtype)
    rng = np.random.default_rng(7)
    cu = np.array([0, 5, 5, 17], np.int32)
    q, k, v, do = (rng.standard_normal((17, 4, 32)).astype(dtype) for _ in range(4))
    o, lse = fa.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True, backend=backend)
    assert o.dtype == dtype
    o_ref = fa.reference.attention_varlen(q, k, v, cu, cu, causal=True)
    tol = 4 * float(ml_dtypes.finfo(dtype).eps)
    np.testing.assert_allclose(o.astype(np.float64), o_ref, rtol=tol, atol=tol)
    grads = fa.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, causal=True, backend=backend)
    refs = fa.reference.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, causal=True)
    for g, r in zip(grads, refs):
        assert g.dtype == dtype
        np.testing.assert_allclose(g.astype(np.float64), r, rtol=8 * tol, atol=8 * tol)


def test_half_inputs_in_strided_layouts(backend, dtype):
    """A packed qkv array is read in place in every dtype; a strided last axis
    is copied once; both give the contiguous answer bit for bit."""
    _need(backend, dtype)
    case = Case(2, 33, 33, 4, 4, 40, causal=True)
    rng = np.random.default_rng(9)
    qkv = rng.standard_normal((2, 33, 3, 4, 40)).astype(dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    o = check_forward(backend, case, q, k, v)[0]
    np.testing.assert_array_equal(o, fa.attention(*(np.ascontiguousarray(x) for x in (q, k, v)),
                                                  causal=True, backend=backend))
    do = np.zeros((2, 33, 4, 80), dtype)[..., ::2]
    do[...] = rng.standard_normal(do.shape).astype(dtype)
    check_backward(backend, case, q, k, v, do)


# ---------------------------------------------------------------- mixing

def _arrays(dtypes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 4, 2, 8)).astype(d) for d in dtypes]


@pytest.mark.parametrize("dtypes", [
    (np.float32, np.float16, np.float16),
    (ml_dtypes.bfloat16, ml_dtypes.bfloat16, np.float16),
    (np.float16, np.float32, ml_dtypes.bfloat16),
])
def test_q_k_v_of_different_dtypes_raise_type_error_naming_each(dtypes):
    q, k, v = _arrays(dtypes)
    with pytest.raises(TypeError) as e:
        fa.attention(q, k, v)
    for name, x in zip("qkv", (q, k, v)):
        assert f"{name} is {x.dtype}" in str(e.value)


@pytest.mark.parametrize("odd", ["do", "o"])
def test_backward_do_and_o_must_have_qs_dtype(odd):
    q, k, v, do = _arrays([np.float16] * 4)
    o, lse = fa.attention(q, k, v, return_lse=True, backend="cpu")
    arrays = dict(do=do, o=o)
    arrays[odd] = arrays[odd].astype(np.float32)
    with pytest.raises(TypeError, match=f"{odd} is float32"):
        fa.attention_backward(arrays["do"], q, k, v, arrays["o"], lse, backend="cpu")


def test_lse_must_be_float32():
    q, k, v, do = _arrays([ml_dtypes.bfloat16] * 4)
    o, lse = fa.attention(q, k, v, return_lse=True, backend="cpu")
    with pytest.raises(TypeError, match="lse must be float32"):
        fa.attention_backward(do, q, k, v, o, lse.astype(ml_dtypes.bfloat16), backend="cpu")


@pytest.mark.parametrize("bad", [np.float64, np.int16, np.uint16, np.complex64])
def test_other_dtypes_are_refused_with_how_to_convert(bad):
    q, k, v = _arrays([np.float32] * 3)
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16.*astype\(np.float32\)"):
        fa.attention(q.astype(bad), k, v)


def test_engines_that_do_not_take_a_dtype_say_so():
    """Refused, never computed in another precision: the message names the
    engine and the dtype."""
    refusals = [(b, n) for b in fa.backends() for n in ("float16", "bfloat16")
                if n not in _core._engine_dtypes(b)]
    if not refusals:
        pytest.skip("every engine here takes every dtype")
    for backend, name in refusals:
        q, k, v = _arrays([DTYPES["f16" if name == "float16" else "bf16"]] * 3)
        with pytest.raises(ValueError, match=f"the {backend} engine does not take {name}"):
            fa.attention(q, k, v, backend=backend)
