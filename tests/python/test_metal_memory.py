"""The metal engine's memory rules (fa.empty, fa.asarray, the pool and its
counters, zero copy, threads) on a Mac, and what the same functions do on a
machine without the metal engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import flashattn as fa
from flashattn import memory

HAVE_METAL = "metal" in fa.backends()
needs_metal = pytest.mark.skipif(
    not HAVE_METAL,
    reason=f"needs the metal engine (macOS, Apple GPU); backends here: {fa.backends()}",
)
no_metal = pytest.mark.skipif(HAVE_METAL, reason="checks the behaviour without a metal engine")


def _qkv(rng, B=2, Tq=37, Tk=53, H=4, Hkv=2, D=24):
    q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    k = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
    return q, k, v


# ---------------------------------------------------------------- everywhere


def test_public_names():
    for name in ("empty", "asarray", "metal_pool_stats", "clear_cache", "set_cache_limit"):
        assert getattr(fa, name) is getattr(memory, name)


def test_empty_shape_and_dtype():
    x = fa.empty((3, 5, 2), np.float32)
    assert isinstance(x, np.ndarray)
    assert x.shape == (3, 5, 2) and x.dtype == np.float32
    assert x.flags.c_contiguous and x.flags.writeable and x.flags.aligned
    x[...] = 7.0
    assert np.all(x == 7.0)
    assert fa.empty(4).shape == (4,)
    assert fa.empty((0, 3)).shape == (0, 3)
    assert fa.empty((2, 2), dtype=np.float64).dtype == np.float64


def test_empty_rejects_bad_arguments():
    with pytest.raises(ValueError, match="negative"):
        fa.empty((2, -1))
    with pytest.raises(TypeError, match="shape"):
        fa.empty((2.5, 3))
    with pytest.raises(TypeError, match="object"):
        fa.empty(3, dtype=object)


def test_asarray_values_and_dtype():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    y = fa.asarray(x)
    assert y.dtype == np.float32 and np.array_equal(x, y)
    z = fa.asarray([[1, 2], [3, 4]], dtype=np.float32)
    assert z.dtype == np.float32 and np.array_equal(z, [[1, 2], [3, 4]])
    assert fa.asarray(x, dtype=np.float64).dtype == np.float64


def test_set_cache_limit_checks_its_argument():
    with pytest.raises(TypeError, match="int"):
        fa.set_cache_limit(1.5)
    with pytest.raises(ValueError, match=">= 0"):
        fa.set_cache_limit(-1)


@no_metal
def test_without_metal_arrays_are_plain_numpy():
    x = np.ones((3, 4), np.float32)
    assert fa.asarray(x) is x  # numpy.asarray semantics: no copy
    assert "metal" not in fa.backends()


@no_metal
@pytest.mark.parametrize(
    "call", [fa.metal_pool_stats, fa.clear_cache, lambda: fa.set_cache_limit(0)],
    ids=["metal_pool_stats", "clear_cache", "set_cache_limit"],
)
def test_without_metal_pool_functions_raise(call):
    with pytest.raises(RuntimeError, match="metal engine is not available"):
        call()


# ---------------------------------------------------------------- on a Mac


@pytest.mark.mac
@needs_metal
def test_empty_is_a_pool_buffer_returned_when_the_array_dies():
    fa.clear_cache()
    before = fa.metal_pool_stats()
    x = fa.empty((256, 1024), np.float32)  # 1 MiB
    during = fa.metal_pool_stats()
    assert memory._in_pool(x) and memory._in_pool(x[3:, ::2])
    assert during["active_bytes"] - before["active_bytes"] >= x.nbytes
    assert during["active_buffers"] == before["active_buffers"] + 1
    view = x[10:20]
    del x
    assert fa.metal_pool_stats()["active_buffers"] == during["active_buffers"]  # the view holds it
    del view
    after = fa.metal_pool_stats()
    assert after["active_buffers"] == before["active_buffers"]
    assert after["cached_bytes"] >= 256 * 1024 * 4
    y = fa.empty((256, 1024), np.float32)  # same size again: reused, not allocated
    assert fa.metal_pool_stats()["reuses"] == after["reuses"] + 1
    del y


@pytest.mark.mac
@needs_metal
def test_asarray_keeps_pool_arrays_and_copies_others():
    x = fa.empty((8, 16), np.float32)
    x[...] = 1.5
    assert fa.asarray(x) is x
    host = np.arange(128, dtype=np.float32).reshape(8, 16)
    y = fa.asarray(host)
    assert y is not host and memory._in_pool(y) and np.array_equal(y, host)
    assert not memory._in_pool(host)


@pytest.mark.mac
@needs_metal
def test_cache_limit_and_clear_cache():
    previous = fa.set_cache_limit(0)
    try:
        x = fa.empty(1 << 20, np.uint8)
        del x
        assert fa.metal_pool_stats()["cached_bytes"] == 0
        assert fa.set_cache_limit(64 << 20) == 0
        x = fa.empty(1 << 20, np.uint8)
        del x
        assert fa.metal_pool_stats()["cached_bytes"] >= 1 << 20
        fa.clear_cache()
        stats = fa.metal_pool_stats()
        assert stats["cached_bytes"] == 0 and stats["cached_buffers"] == 0
    finally:
        fa.set_cache_limit(previous)


def _copies(before, after):
    return {k: after[k] - before[k] for k in ("inputs_in_place", "inputs_no_copy",
                                                 "inputs_no_copy_bytes", "input_copies",
                                                 "input_copy_bytes", "outputs_in_place",
                                                 "output_copies")}


@pytest.mark.mac
@needs_metal
def test_host_inputs_are_bound_without_a_copy_and_outputs_are_pool_buffers():
    q, k, v = _qkv(np.random.default_rng(1))
    before = fa.metal_pool_stats()
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True, backend="metal")
    d = _copies(before, fa.metal_pool_stats())
    # newBufferWithBytesNoCopy over each array's page-rounded span.
    assert d["inputs_no_copy"] == 3 and d["input_copies"] == 0 and d["inputs_in_place"] == 0
    assert d["inputs_no_copy_bytes"] == q.nbytes + k.nbytes + v.nbytes
    assert d["outputs_in_place"] == 2 and d["output_copies"] == 0
    assert memory._in_pool(o) and memory._in_pool(lse)
    ref_o, ref_lse = fa.reference.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(o, ref_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-5)


@pytest.mark.mac
@needs_metal
def test_an_input_the_engine_cannot_read_is_copied_once_into_the_pool():
    q, k, v = _qkv(np.random.default_rng(5))
    q_f = np.asfortranarray(q)  # last axis strided: the Python layer copies it
    before = fa.metal_pool_stats()
    o = fa.attention(q_f, k, v, backend="metal")
    d = _copies(before, fa.metal_pool_stats())
    assert d["inputs_in_place"] == 1  # q's copy was made in a pool buffer
    assert d["inputs_no_copy"] == 2 and d["input_copies"] == 0
    np.testing.assert_allclose(o, fa.reference.attention(q, k, v), rtol=1e-4, atol=1e-5)


@pytest.mark.mac
@needs_metal
def test_a_broadcast_view_is_bound_as_its_span_never_expanded():
    rng = np.random.default_rng(6)
    B, Tq, Tk, H, D = 2, 33, 5000, 2, 16
    q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    row = rng.standard_normal((1, 1, H, D), dtype=np.float32)
    k = np.broadcast_to(row, (B, Tk, H, D))  # stride 0 over B and Tk
    v = np.broadcast_to(row * 2, (B, Tk, H, D))
    before = fa.metal_pool_stats()
    o = fa.attention(q, k, v, backend="metal")
    d = _copies(before, fa.metal_pool_stats())
    assert d["inputs_no_copy"] + d["input_copies"] == 3
    assert d["inputs_no_copy_bytes"] + d["input_copy_bytes"] == q.nbytes + 2 * row.nbytes
    np.testing.assert_allclose(o, np.broadcast_to(row * 2, q.shape), rtol=1e-5, atol=1e-5)


def test_contiguous_copy_is_c_ordered_and_equal():
    x = np.asfortranarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    y = memory._contiguous_copy(x)
    assert y.flags.c_contiguous and np.array_equal(x, y) and y is not x
    assert memory._in_pool(y) == HAVE_METAL


@pytest.mark.mac
@needs_metal
def test_pool_inputs_are_read_in_place():
    rng = np.random.default_rng(2)
    B, T, H, D = 2, 45, 4, 32
    qkv = fa.empty((B, T, 3, H, D), np.float32)  # packed: q, k, v are strided slices
    qkv[...] = rng.standard_normal(qkv.shape, dtype=np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    before = fa.metal_pool_stats()
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True, backend="metal")
    d = _copies(before, fa.metal_pool_stats())
    assert d["inputs_in_place"] == 3 and d["input_copies"] == 0 and d["input_copy_bytes"] == 0
    np.testing.assert_allclose(o, fa.reference.attention(q, k, v, causal=True),
                               rtol=1e-4, atol=1e-5)

    # Backward: outputs of the forward (pool buffers) and pool inputs: no copy at all.
    do = fa.asarray(rng.standard_normal(q.shape, dtype=np.float32))
    before = fa.metal_pool_stats()
    dq, dk, dv = fa.attention_backward(do, q, k, v, o, lse, causal=True, backend="metal")
    d = _copies(before, fa.metal_pool_stats())
    assert d["input_copies"] == 0 and d["inputs_in_place"] == 6
    assert d["outputs_in_place"] == 3
    rq, rk, rv = fa.reference.attention_backward(do, q, k, v, causal=True)
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.mac
@needs_metal
def test_outputs_return_to_the_pool_when_they_die():
    q, k, v = (fa.asarray(x) for x in _qkv(np.random.default_rng(3)))
    o = fa.attention(q, k, v, backend="metal")
    active = fa.metal_pool_stats()["active_bytes"]
    nbytes = o.nbytes
    del o
    assert fa.metal_pool_stats()["active_bytes"] <= active - nbytes


@pytest.mark.mac
@needs_metal
def test_concurrent_calls_match_sequential_ones():
    rng = np.random.default_rng(4)
    cases = [_qkv(rng, Tq=29 + 7 * i, Tk=61) for i in range(6)]
    expected = [fa.attention(*c, causal=True, backend="metal") for c in cases]
    results = [[None] * len(cases) for _ in range(4)]
    errors = []

    def work(t):
        try:
            for i, c in enumerate(cases):
                results[t][i] = fa.attention(*c, causal=True, backend="metal")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for per_thread in results:
        for got, want in zip(per_thread, expected):
            assert np.array_equal(got, want)  # deterministic: bit-identical
