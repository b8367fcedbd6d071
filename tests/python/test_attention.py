"""The forward pass of every engine against the float64 reference, by
FlashAttention's rule (helpers.assert_close_to_reference): the grid of head
layouts, masks, sequence lengths and head sizes, then memory layouts (packed
qkv read in place, other layouts copied once)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import flashattn as fa
from helpers import GRID, Case, check_forward, inputs


@pytest.mark.parametrize("case", GRID, ids=lambda c: c.id)
def test_forward_matches_reference(backend, case, dtype):
    q, k, v, _ = inputs(case, dtype=dtype)
    check_forward(backend, case, q, k, v)


@pytest.mark.parametrize("scale", [0.0, -0.3, 0.01, 0.5, 1.0])
def test_explicit_scale(backend, scale, dtype):
    case = Case(2, 17, 23, 4, 2, 40, causal=True)
    q, k, v, _ = inputs(case, seed=1, dtype=dtype)
    check_forward(backend, case, q, k, v, scale=scale)


def test_default_scale_is_inverse_sqrt_d(backend):
    case = Case(1, 9, 11, 2, 2, 48)
    q, k, v, _ = inputs(case, seed=2)
    o_default = fa.attention(q, k, v, backend=backend)
    o_explicit = fa.attention(q, k, v, scale=1 / np.sqrt(48), backend=backend)
    np.testing.assert_array_equal(o_default, o_explicit)


def test_return_lse_false_gives_o_only(backend):
    case = Case(1, 5, 6, 2, 1, 8)
    q, k, v, _ = inputs(case)
    o = fa.attention(q, k, v, backend=backend)
    assert isinstance(o, np.ndarray) and o.shape == q.shape and o.dtype == np.float32
    o2, lse = fa.attention(q, k, v, return_lse=True, backend=backend)
    np.testing.assert_array_equal(o, o2)


def test_window_wider_than_sequence_is_unbounded(backend):
    case = Case(1, 21, 30, 2, 2, 16)
    q, k, v, _ = inputs(case, seed=3)
    for causal in (False, True):
        wide = fa.attention(q, k, v, causal=causal, window=(10**6, 2**40), backend=backend)
        full = fa.attention(q, k, v, causal=causal, backend=backend)
        np.testing.assert_array_equal(wide, full)


def test_default_backend_is_the_first_listed():
    case = Case(1, 7, 9, 2, 1, 16, causal=True)
    q, k, v, _ = inputs(case)
    first = fa.backends()[0]
    np.testing.assert_array_equal(fa.attention(q, k, v, **case.opts()),
                                  fa.attention(q, k, v, backend=first, **case.opts()))


def test_outputs_are_independent_arrays(backend):
    """Each call returns fresh, writable arrays: a later call (which may reuse
    pooled memory) never changes an earlier result, and writing to a result
    changes nothing else."""
    case = Case(1, 12, 12, 2, 2, 16, causal=True)
    q, k, v, do = inputs(case, seed=12)
    o1, lse1 = fa.attention(q, k, v, return_lse=True, backend=backend, causal=True)
    keep = o1.copy(), lse1.copy()
    o2, lse2 = fa.attention(2 * q, k, v, return_lse=True, backend=backend, causal=True)
    grads = fa.attention_backward(do, q, k, v, o1, lse1, backend=backend, causal=True)
    np.testing.assert_array_equal(o1, keep[0])
    np.testing.assert_array_equal(lse1, keep[1])
    outputs = [o1, lse1, o2, lse2, *grads]
    for i, a in enumerate(outputs):
        assert a.flags.writeable
        for b in outputs[i + 1:]:
            assert not np.shares_memory(a, b)
    o1[...] = 7
    np.testing.assert_array_equal(o2, fa.attention(2 * q, k, v, backend=backend, causal=True))


# ------------------------------------------------------------- memory layouts

def _peak_traced_bytes(fn):
    """Peak bytes NumPy allocated while fn ran (NumPy reports its buffers to
    tracemalloc; engine outputs are not NumPy allocations and do not count)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_packed_qkv_is_read_in_place(backend):
    B, T, H, D = 2, 96, 4, 64
    case = Case(B, T, T, H, H, D, causal=True)
    qkv = np.random.default_rng(4).standard_normal((B, T, 3, H, D), dtype=np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    check_forward(backend, case, q, k, v)
    _, peak = _peak_traced_bytes(lambda: fa.attention(q, k, v, causal=True, backend=backend))
    assert peak < q.nbytes // 4, f"packed q, k, v were copied: {peak} bytes allocated"
    # The measurement sees a copy when there is one: a Fortran-order q costs one.
    qf = np.asfortranarray(q)
    o, peak = _peak_traced_bytes(lambda: fa.attention(qf, k, v, causal=True, backend=backend))
    assert q.nbytes <= peak < 2 * q.nbytes + 65536
    np.testing.assert_array_equal(o, fa.attention(np.ascontiguousarray(q), np.ascontiguousarray(k),
                                                  np.ascontiguousarray(v), causal=True,
                                                  backend=backend))


def test_packed_kv_gqa_is_read_in_place(backend):
    B, Tq, Tk, H, Hkv, D = 1, 33, 70, 6, 2, 59
    case = Case(B, Tq, Tk, H, Hkv, D, window=(20, 4))
    rng = np.random.default_rng(5)
    q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    kv = rng.standard_normal((B, Tk, 2, Hkv, D), dtype=np.float32)
    k, v = kv[:, :, 0], kv[:, :, 1]
    check_forward(backend, case, q, k, v)
    _, peak = _peak_traced_bytes(lambda: fa.attention(q, k, v, window=(20, 4), backend=backend))
    assert peak < k.nbytes // 4, f"packed k, v were copied: {peak} bytes allocated"


def _layouts(case: Case, seed=6):
    """(name, q, k, v): the same values in memory layouts the contract accepts."""
    q, k, v, _ = inputs(case, seed=seed)
    rng = np.random.default_rng(seed + 1)

    def heads_major(x):  # stored (B, heads, T, D), viewed (B, T, heads, D): last axis contiguous
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    def strided_last_axis(x):  # every other float: last-axis stride 2, copied once
        wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), np.float32)
        wide[..., ::2] = x
        return wide[..., ::2]

    def reversed_time(x):  # negative stride on T
        return np.ascontiguousarray(x[:, ::-1])[:, ::-1]

    def unaligned(x):  # float32 data at an odd byte address
        buf = np.zeros(x.size * 4 + 1, np.uint8)
        y = np.frombuffer(buf.data, dtype=np.float32, count=x.size, offset=1).reshape(x.shape)
        y = y.copy() if y.flags.writeable is False else y
        y[...] = x
        return y

    def padded(x):  # slice of a larger array: every stride differs from contiguous
        big = rng.standard_normal((x.shape[0] + 1, x.shape[1] + 3, x.shape[2] + 2, x.shape[3] + 5)).astype(np.float32)
        big[1:, 2:-1, 1:-1, 3:-2] = x
        return big[1:, 2:-1, 1:-1, 3:-2]

    yield "contiguous", q, k, v
    yield "fortran", np.asfortranarray(q), np.asfortranarray(k), np.asfortranarray(v)
    yield "heads-major", heads_major(q), heads_major(k), heads_major(v)
    yield "strided-last-axis", strided_last_axis(q), strided_last_axis(k), strided_last_axis(v)
    yield "reversed-time", reversed_time(q), reversed_time(k), reversed_time(v)
    yield "unaligned", unaligned(q), unaligned(k), unaligned(v)
    yield "padded", padded(q), padded(k), padded(v)


@pytest.mark.parametrize("name", ["fortran", "heads-major", "strided-last-axis", "reversed-time",
                                  "unaligned", "padded"])
def test_any_float32_layout_gives_the_contiguous_result(backend, name):
    case = Case(2, 19, 27, 4, 2, 24, causal=True, window=(9, 0))
    layouts = {n: (q, k, v) for n, q, k, v in _layouts(case)}
    q, k, v = layouts[name]
    want = layouts["contiguous"]
    for x, y in zip((q, k, v), want):
        np.testing.assert_array_equal(x, y)  # same values, different memory
    check_forward(backend, case, q, k, v)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **case.opts())
    o_c, lse_c = fa.attention(*want, return_lse=True, backend=backend, **case.opts())
    # Layout changes where the values are read from, not the arithmetic.
    np.testing.assert_array_equal(o, o_c)
    np.testing.assert_array_equal(lse, lse_c)


def test_zero_stride_broadcast_kv(backend):
    """k and v broadcast over heads and time (np.broadcast_to: zero strides)."""
    B, Tq, Tk, H, Hkv, D = 2, 17, 40, 4, 2, 32
    rng = np.random.default_rng(8)
    q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    k_row = rng.standard_normal((B, 1, 1, D), dtype=np.float32)
    v_rows = rng.standard_normal((B, Tk, 1, D), dtype=np.float32)
    k = np.broadcast_to(k_row, (B, Tk, Hkv, D))
    v = np.broadcast_to(v_rows, (B, Tk, Hkv, D))
    assert k.strides[1] == 0 and v.strides[2] == 0
    case = Case(B, Tq, Tk, H, Hkv, D, causal=True)
    check_forward(backend, case, q, k, v)
    # Every visible key has the same score: o is the mean of the visible v rows.
    o = fa.attention(q, k, v, causal=True, backend=backend)
    for i in (0, Tq // 2, Tq - 1):
        p = i + Tk - Tq
        np.testing.assert_allclose(o[:, i], np.broadcast_to(v_rows[:, : p + 1].mean(axis=1), o[:, i].shape),
                                   rtol=2e-5, atol=2e-6)
