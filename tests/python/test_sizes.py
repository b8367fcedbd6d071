"""Sizes past 32-bit offsets and past memory: inputs of more than 2**31
logical elements through zero or overlapping strides (no copy, 64-bit
element offsets), an output of more than 2**31 elements, and requests that
cannot be allocated (MemoryError, and the process carries on)."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import flashattn as fa
from helpers import Case, check_forward

F32 = np.dtype(np.float32).itemsize


def sliding_rows(base, T, D):
    """A (1, T, 1, D) read-only view whose row t is base[t : t + D]: T * D
    logical elements in T + D floats of memory."""
    assert base.size >= T + D - 1
    return as_strided(base, shape=(1, T, 1, D), strides=(0, F32, 0, F32), writeable=False)


def test_keys_beyond_2_31_elements_with_a_window(backend):
    """Tk = 2**25 + 3 keys of D = 64 (over 2**31 logical elements each for k
    and v, 128 MiB of memory each); a causal window of 6 keys keeps the work
    small. The last rows' answers match the reference on the keys they see."""
    D, Tq, H, left = 64, 5, 2, 5
    Tk = 2**25 + 3
    rng = np.random.default_rng(40)
    k = sliding_rows(rng.standard_normal(Tk + D, dtype=np.float32), Tk, D)
    v = sliding_rows(rng.standard_normal(Tk + D, dtype=np.float32), Tk, D)
    q = rng.standard_normal((1, Tq, H, D), dtype=np.float32)
    assert k.size > 2**31 and v.size > 2**31
    o, lse = fa.attention(q, k, v, causal=True, window=(left, 0), return_lse=True, backend=backend)
    # The keys the rows see are the last Tq + left: the same call on them alone.
    tail = Tk - Tq - left
    k_tail, v_tail = np.array(k[:, tail:]), np.array(v[:, tail:])
    case = Case(1, Tq, Tq + left, H, 1, D, causal=True, window=(left, 0))
    o_tail, lse_tail = check_forward(backend, case, q, k_tail, v_tail)
    np.testing.assert_array_equal(o, o_tail)
    np.testing.assert_array_equal(lse, lse_tail)


BIG_ROWS = Case(1, 2**25 + 8, 2, 1, 1, 64, causal=True)  # o: 2**31 + 512 floats (8 GiB)


@pytest.mark.slow
@pytest.mark.parametrize("case", [BIG_ROWS], ids=["o-2^31+512"])
def test_output_beyond_2_31_elements(backend, case):
    """q broadcast over 2**25 + 8 rows (zero strides, 256 bytes of memory);
    causal with Tk = 2: only the last two rows see a key, the rest are 0 and
    -inf. The rows past element 2**31 land where they belong."""
    rng = np.random.default_rng(41)
    q_row = rng.standard_normal((1, 1, 1, case.D), dtype=np.float32)
    q = np.broadcast_to(q_row, (1, case.Tq, 1, case.D))
    k = rng.standard_normal((1, 2, 1, case.D), dtype=np.float32)
    v = rng.standard_normal((1, 2, 1, case.D), dtype=np.float32)
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    assert o.shape == q.shape and o.size > 2**31
    T = case.Tq
    step = 2**22
    for start in range(0, T - 2, step):
        stop = min(start + step, T - 2)
        assert not np.any(o[0, start:stop]), f"rows {start}..{stop} should be 0"
        assert np.all(np.isneginf(lse[0, 0, start:stop]))
    tail = Case(1, 2, 2, 1, 1, case.D, causal=True)
    o_tail, lse_tail = check_forward(backend, tail, np.ascontiguousarray(q[:, -2:]), k, v)
    np.testing.assert_array_equal(o[:, -2:], o_tail)
    np.testing.assert_array_equal(lse[:, :, -2:], lse_tail)
    del o, lse


def _still_works(backend):
    case = Case(1, 9, 12, 2, 1, 16, causal=True)
    rng = np.random.default_rng(42)
    q = rng.standard_normal((1, 9, 2, 16), dtype=np.float32)
    k = rng.standard_normal((1, 12, 1, 16), dtype=np.float32)
    check_forward(backend, case, q, k, k)


def test_unallocatable_forward_raises_memory_error(backend):
    """o would be 2**48 floats (1 PiB): beyond any address space."""
    q = np.broadcast_to(np.ones((1, 1, 1, 256), np.float32), (2**10, 2**20, 2**10, 256))
    k = np.ones((2**10, 1, 1, 256), np.float32)
    with pytest.raises(MemoryError):
        fa.attention(q, k, k, backend=backend)
    _still_works(backend)


def test_unallocatable_backward_raises_memory_error(backend):
    """dk, dv would be 2**46 floats (256 TiB) each: Tk = 2**28 keys broadcast (zero
    strides) over 1024 kv heads of D = 256; everything else is small."""
    D, H, Tk = 256, 2**10, 2**28
    rng = np.random.default_rng(43)
    q = rng.standard_normal((1, 1, H, D), dtype=np.float32)
    k = np.broadcast_to(np.ones((1, 1, 1, D), np.float32), (1, Tk, H, D))
    assert k.size == 2**46
    o = np.zeros_like(q)
    lse = np.zeros((1, H, 1), np.float32)
    with pytest.raises(MemoryError):
        fa.attention_backward(q, q, k, k, o, lse, backend=backend)
    _still_works(backend)
