"""flashattn.mlx in MLX's stream (flashattn._instream.mlx_stream): here the
generated kernels run under metal-sim's stand-in for mx.fast.metal_kernel,
which compiles nothing at run time but runs the build's copy of the very
text MLX would compile. Every dtype and score option: the bits of the
metal-sim engine (same kernels, same plan) and FlashAttention's rule
against the float64 reference; gradients through mx.grad and the
custom_function's vjp; the dispatches are the metal engine's schedule,
pieces and split-KV included. On a Mac, the same against MLX itself."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="flashattn.mlx needs mlx: pip install '.[mlx]'")

import flashattn as fa  # noqa: E402
import flashattn.mlx as fam  # noqa: E402
from flashattn._instream import call, mlx_stream, sim  # noqa: E402
from helpers import (FORWARD_FACTOR, GRADIENT_FACTOR, Case, assert_close_to_reference,  # noqa: E402
                     inputs)
from instream_cases import OPTIONS, options  # noqa: E402

ON_MAC_GPU = mx.metal.is_available()
needs_mac = pytest.mark.skipif(not ON_MAC_GPU, reason="needs MLX's Metal back end (a Mac with "
                                                      "Apple silicon): here MLX is CPU-only")


@pytest.fixture
def host(monkeypatch):
    """flashattn.mlx's in-stream host, over metal-sim's metal_kernel."""
    h = mlx_stream.Host(sim.metal_kernel)
    monkeypatch.setattr(mlx_stream, "HOST", h)
    sim.CALLS.clear()
    return h


def to_mx(x):
    x = np.asarray(x)
    if x.dtype == ml_dtypes.bfloat16:
        return mx.array(x.view(np.uint16)).view(mx.bfloat16)
    return mx.array(x)


def to_np(x):
    if x.dtype == mx.bfloat16:
        return np.array(x.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(x)


CASE = Case(2, 19, 29, 4, 2, 24)


def _mx_options(opts):
    return {k: to_mx(v) if isinstance(v, np.ndarray) else v for k, v in opts.items()}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_dtype_and_option_equals_metal_sim_and_the_reference(host, dtype, option):
    rng = np.random.default_rng(7)
    q, k, v, do = inputs(CASE, seed=3, dtype=dtype)
    opts = options(option, CASE, rng)
    mopts = _mx_options(opts)
    o, lse = mlx_stream.forward(host, to_mx(q), to_mx(k), to_mx(v), **mopts)
    grads = mlx_stream.backward(host, to_mx(do), to_mx(q), to_mx(k), to_mx(v), o, lse, **mopts)
    o, lse, grads = to_np(o), to_np(lse), [to_np(g) for g in grads]

    o_sim, lse_sim = fa.attention(q, k, v, return_lse=True, backend="metal-sim", **opts)
    grads_sim = fa.attention_backward(do, q, k, v, o_sim, lse_sim, backend="metal-sim", **opts)
    np.testing.assert_array_equal(o.view(np.uint8), o_sim.view(np.uint8))
    np.testing.assert_array_equal(lse, lse_sim)
    for got, want in zip(grads[:3], grads_sim[:3]):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    if "sinks" in opts:  # MLX sums dsinks in float32 (the core in double)
        np.testing.assert_allclose(grads[3], grads_sim[3], rtol=1e-5, atol=1e-6)

    o64, lse64 = fa.reference.attention(q, k, v, return_lse=True, **opts)
    o32, lse32 = fa.reference.attention(q, k, v, return_lse=True, dtype=np.float32, **opts)
    assert_close_to_reference(o, o64, o32, factor=FORWARD_FACTOR, backend="mlx in-stream (sim)",
                              name="o", dtype=dtype)
    assert_close_to_reference(lse, lse64, lse32, factor=FORWARD_FACTOR,
                              backend="mlx in-stream (sim)", name="lse", dtype=dtype,
                              out_dtype=np.float32)
    refs = fa.reference.attention_backward(do, q, k, v, **opts)
    bases = fa.reference.attention_backward(do, q, k, v, o, lse, dtype=np.float32,
                                            delta_from_o=True, **opts)
    magnitude = max(float(np.abs(r).max()) for r in refs[:3])
    for name, got, ref, base in zip(("dq", "dk", "dv"), grads, refs, bases):
        assert_close_to_reference(got, ref, base, factor=GRADIENT_FACTOR,
                                  backend="mlx in-stream (sim)", name=name, magnitude=magnitude,
                                  dtype=dtype)


def _dispatches():
    return [(c["kernel"].split("_fc")[0][len("flashattn_"):], c["grid"], c["arguments"]["fa_in_p"])
            for c in sim.CALLS]


def _planned(plan):
    return [(plan.launches[p.launch].kernel, p.grid, p.params) for p in plan.pieces]


@pytest.mark.parametrize("shape", [(1, 1, 700, 4, 2, 32), (2, 3, 2000, 2, 1, 64),
                                   (1, 2, 2000, 4, 4, 96)], ids=str)
def test_decode_splits_the_keys_as_the_metal_engine_does(host, shape):
    """GQA decode runs the tiled kernel, MHA decode the vector one
    (flash_decode.metal); both split the keys and merge."""
    B, Tq, Tk, H, Hkv, D = shape
    q, k, v, do = inputs(Case(B, Tq, Tk, H, Hkv, D), seed=1)
    o, lse = mlx_stream.forward(host, to_mx(q), to_mx(k), to_mx(v))
    plan = call.plan("forward", "float32", call.contiguous(q.shape), call.contiguous(k.shape),
                     call.contiguous(v.shape))
    assert len(plan.launches) == 2 and plan.launches[1].kernel == "flash_fwd_merge_f32"
    family = "flash_decode_f32_hd" if H == Hkv else "flash_fwd_f32_hd"
    assert plan.launches[0].kernel.startswith(family)
    assert _dispatches() == _planned(plan)
    o_sim, lse_sim = fa.attention(q, k, v, return_lse=True, backend="metal-sim")
    np.testing.assert_array_equal(to_np(o), o_sim)
    np.testing.assert_array_equal(to_np(lse), lse_sim)


def test_pieces_are_the_metal_engines_and_give_the_same_bits(host, monkeypatch):
    case = Case(2, 70, 45, 4, 2, 40, causal=True)
    q, k, v, do = inputs(case, seed=2)
    whole = mlx_stream.forward(host, to_mx(q), to_mx(k), to_mx(v), causal=True)
    monkeypatch.setenv("FLASHATTN_MAX_GROUPS_PER_PIECE", "3")
    sim.CALLS.clear()
    cut = mlx_stream.forward(host, to_mx(q), to_mx(k), to_mx(v), causal=True)
    plan = call.plan("forward", "float32", call.contiguous(q.shape), call.contiguous(k.shape),
                     call.contiguous(v.shape), causal=True)
    assert len(plan.pieces) > 5 and _dispatches() == _planned(plan)
    for a, b in zip(whole, cut):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    sim.CALLS.clear()
    grads = mlx_stream.backward(host, to_mx(do), to_mx(q), to_mx(k), to_mx(v), *cut, causal=True)
    plan = call.plan("backward", "float32", call.contiguous(q.shape), call.contiguous(k.shape),
                     call.contiguous(v.shape), do=call.contiguous(q.shape),
                     o=call.contiguous(q.shape), lse=call.contiguous((2, 4, 70)), causal=True)
    assert _dispatches() == _planned(plan)
    o_np, lse_np = (to_np(x) for x in cut)
    for got, want in zip(grads, fa.attention_backward(do, q, k, v, o_np, lse_np, causal=True,
                                                      backend="metal-sim")):
        np.testing.assert_array_equal(to_np(got), want)


def test_grad_through_the_custom_function_runs_in_stream(host):
    case = Case(2, 21, 33, 4, 1, 16)
    q, k, v, do = inputs(case, seed=4)
    Q, K, V, DO = (to_mx(x) for x in (q, k, v, do))
    opts = dict(causal=True, window=(9, 0))
    o = fam.attention(Q, K, V, **opts)
    grads = mx.grad(lambda q, k, v: (fam.attention(q, k, v, **opts) * DO).sum(),
                    argnums=(0, 1, 2))(Q, K, V)
    kernels = {c["kernel"].split("_fc")[0] for c in sim.CALLS}
    assert kernels == {"flashattn_flash_fwd_f32_hd32", "flashattn_flash_bwd_preprocess_f32",
                       "flashattn_flash_bwd_dq_f32_hd32", "flashattn_flash_bwd_dkdv_f32_hd32"}
    o_np, lse = fa.attention(q, k, v, return_lse=True, backend="metal-sim", **opts)
    np.testing.assert_array_equal(np.array(o), o_np)
    for got, want in zip(grads, fa.attention_backward(do, q, k, v, o_np, lse,
                                                      backend="metal-sim", **opts)):
        np.testing.assert_array_equal(np.array(got), want)


def test_empty_calls_answer_as_the_engines_do(host):
    q = mx.zeros((1, 3, 2, 8))
    k = mx.zeros((1, 0, 2, 8))
    sinks = mx.array([0.5, -np.inf], dtype=mx.float32)
    o, lse = mlx_stream.forward(host, q, k, k, sinks=sinks)
    assert np.array(o).tolist() == np.zeros((1, 3, 2, 8)).tolist()
    assert np.array(lse).tolist() == [[[0.5] * 3, [-np.inf] * 3]]
    assert not sim.CALLS


def test_shape_errors_are_the_engines(host):
    q = mx.zeros((1, 4, 3, 8))
    with pytest.raises(ValueError, match="number of query heads H=3 must be a multiple"):
        mlx_stream.forward(host, q, mx.zeros((1, 4, 2, 8)), mx.zeros((1, 4, 2, 8)))
    with pytest.raises(ValueError, match=r"mask must be broadcastable to \(B, H, Tq, Tk\)"):
        mlx_stream.forward(host, q, q, q, mask=mx.zeros((5, 4), dtype=mx.bool_))
    with pytest.raises(TypeError, match="share one dtype"):
        mlx_stream.forward(host, q, q.astype(mx.float16), q)


def test_host_copy_path_refuses_mx_compile_naming_flashattn(monkeypatch):
    monkeypatch.setattr(mlx_stream, "HOST", None)
    if ON_MAC_GPU:
        pytest.skip("on a Mac with MLX's GPU, flashattn.mlx runs in-stream (compiles fine)")
    q = mx.zeros((1, 8, 2, 16))
    with pytest.raises(RuntimeError, match=r"^flashattn.mlx.attention: cannot run inside "
                                           r"mx.compile .* on the host-copy path"):
        mx.compile(lambda q: fam.attention(q, q, q))(q)


# ---- On a Mac: MLX itself.

@needs_mac
@pytest.mark.mac
@pytest.mark.parametrize("mlx_dtype", ["float32", "float16", "bfloat16"])
def test_mac_in_stream_equals_the_metal_engine(monkeypatch, mlx_dtype):
    monkeypatch.setattr(mlx_stream, "HOST", None)
    assert mlx_stream.host() is not None
    case = Case(2, 77, 130, 8, 2, 64)
    dt = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[mlx_dtype]
    q, k, v, do = inputs(case, seed=5, dtype=dt)
    rng = np.random.default_rng(0)
    opts = options("all", case, rng)
    mopts = _mx_options(opts)
    o, lse = mlx_stream.forward(mlx_stream.host(), to_mx(q), to_mx(k), to_mx(v), **mopts)
    grads = mlx_stream.backward(mlx_stream.host(), to_mx(do), to_mx(q), to_mx(k), to_mx(v), o,
                                lse, **mopts)
    o_m, lse_m = fa.attention(q, k, v, return_lse=True, backend="metal", **opts)
    np.testing.assert_array_equal(to_np(o).view(np.uint8), o_m.view(np.uint8))
    np.testing.assert_array_equal(to_np(lse), lse_m)
    for got, want in zip(grads[:3], fa.attention_backward(do, q, k, v, o_m, lse_m,
                                                          backend="metal", **opts)):
        np.testing.assert_array_equal(to_np(got).view(np.uint8), want.view(np.uint8))


@needs_mac
@pytest.mark.mac
def test_mac_grad_under_mx_compile(monkeypatch):
    monkeypatch.setattr(mlx_stream, "HOST", None)
    q, k, v, do = inputs(Case(1, 64, 64, 4, 4, 32), seed=6)
    Q, K, V, DO = (mx.array(x) for x in (q, k, v, do))

    def loss(q, k, v):
        return (fam.attention(q, k, v, causal=True) * DO).sum()

    eager = mx.grad(loss, argnums=(0, 1, 2))(Q, K, V)
    compiled = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))(Q, K, V)
    for a, b in zip(eager, compiled):
        np.testing.assert_array_equal(np.array(a), np.array(b))
