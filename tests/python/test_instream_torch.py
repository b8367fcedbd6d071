"""flashattn.torch in torch's MPS stream (flashattn._instream.torch_stream):
here the generated libraries run under metal-sim's stand-in for
torch.mps.compile_shader, on CPU tensors standing in for MPS ones. Every
dtype and score option gives the metal-sim engine's bits; strided inputs
are bound where they are (no copy); the dispatches are the metal engine's
schedule; autograd and torch.compile go through the custom ops as on the
host-copy path. On a Mac, the same against MPS itself."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="flashattn.torch needs torch: pip install '.[torch]'")

import flashattn as fa  # noqa: E402
import flashattn.torch as fat  # noqa: E402
from flashattn._instream import call, sim, torch_stream  # noqa: E402
from helpers import Case, inputs  # noqa: E402
from instream_cases import options  # noqa: E402

ON_MPS = torch_stream.supported()


@pytest.fixture
def host(monkeypatch):
    """flashattn.torch's in-stream host over metal-sim's compile_shader,
    taking CPU tensors as it takes MPS ones."""
    commits = []
    h = torch_stream.Host(sim.compile_shader, commit=lambda: commits.append(len(sim.CALLS)))
    h.commits = commits
    monkeypatch.setattr(torch_stream, "HOST", h)
    monkeypatch.setattr(torch_stream, "DEVICES", ("mps", "cpu"))
    sim.CALLS.clear()
    return h


def to_torch(x):
    x = np.asarray(x)
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def to_np(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.mark.parametrize("option", ["plain", "causal-window", "alibi-BH", "mask-float", "all"])
def test_every_dtype_and_option_equals_metal_sim(host, dtype, option):
    case = Case(2, 19, 29, 4, 2, 24)
    q, k, v, do = inputs(case, seed=3, dtype=dtype)
    opts = options(option, case, np.random.default_rng(7))
    topts = {k: to_torch(v) if isinstance(v, np.ndarray) else v for k, v in opts.items()}
    o, lse = torch_stream.forward(host, to_torch(q), to_torch(k), to_torch(v), **topts)
    grads = torch_stream.backward(host, to_torch(do), to_torch(q), to_torch(k), to_torch(v), o,
                                  lse, **topts)
    o_sim, lse_sim = fa.attention(q, k, v, return_lse=True, backend="metal-sim", **opts)
    grads_sim = fa.attention_backward(do, q, k, v, o_sim, lse_sim, backend="metal-sim", **opts)
    np.testing.assert_array_equal(to_np(o).view(np.uint8), o_sim.view(np.uint8))
    np.testing.assert_array_equal(to_np(lse), lse_sim)
    for got, want in zip(grads[:3], grads_sim[:3]):
        np.testing.assert_array_equal(to_np(got).view(np.uint8), want.view(np.uint8))
    if "sinks" in opts:
        np.testing.assert_allclose(to_np(grads[3]), grads_sim[3], rtol=1e-5, atol=1e-6)
    assert not host.commits  # one command buffer's work


@pytest.mark.parametrize("option", ["plain", "all"])
def test_mha_decode_runs_the_vector_kernel_and_equals_metal_sim(host, dtype, option):
    """MHA decode (group 1, Tq <= 8): flash_decode's generated source, split
    keys and the merge, bit for bit the metal-sim engine's."""
    case = Case(1, 2, 1500, 4, 4, 64, causal=True)
    q, k, v, _ = inputs(case, seed=5, dtype=dtype)
    opts = options(option, case, np.random.default_rng(8))
    topts = {k: to_torch(v) if isinstance(v, np.ndarray) else v for k, v in opts.items()}
    o, lse = torch_stream.forward(host, to_torch(q), to_torch(k), to_torch(v), **topts)
    kernels = [c["kernel"] for c in sim.CALLS]
    assert kernels[0].startswith("flash_decode_") and kernels[-1].startswith("flash_fwd_merge_")
    o_sim, lse_sim = fa.attention(q, k, v, return_lse=True, backend="metal-sim", **opts)
    np.testing.assert_array_equal(to_np(o).view(np.uint8), o_sim.view(np.uint8))
    np.testing.assert_array_equal(to_np(lse), lse_sim)


def test_packed_and_transposed_inputs_are_read_in_place(host):
    case = Case(2, 33, 33, 4, 4, 16)
    q, k, v, do = inputs(case, seed=8)
    qkv = to_torch(np.stack([q, k, v], axis=2))  # (B, T, 3, H, D)
    tq, tk, tv = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    o, lse = torch_stream.forward(host, tq, tk, tv, causal=True)
    # The kernel read the slices' own strides: nothing was made contiguous.
    assert tq.stride() == (33 * 3 * 64, 3 * 64, 16, 1)
    strided = call.plan("forward", "float32", *[(tuple(x.shape), x.stride()) for x in (tq, tk, tv)],
                        causal=True)
    packed = call.plan("forward", "float32", *[call.contiguous(x.shape) for x in (tq, tk, tv)],
                       causal=True)
    assert [c["arguments"][5] for c in sim.CALLS] == [p.params for p in strided.pieces]
    assert strided.params != packed.params
    o_sim, lse_sim = fa.attention(q, k, v, causal=True, return_lse=True, backend="metal-sim")
    np.testing.assert_array_equal(to_np(o), o_sim)
    np.testing.assert_array_equal(to_np(lse), lse_sim)


def test_pieces_and_command_buffers_are_the_metal_engines(host, monkeypatch):
    monkeypatch.setenv("FLASHATTN_MAX_GROUPS_PER_PIECE", "2")
    case = Case(1, 70, 70, 2, 2, 32)
    q, k, v, do = inputs(case, seed=9)
    o, lse = torch_stream.forward(host, to_torch(q), to_torch(k), to_torch(v), causal=True)
    plan = call.plan("forward", "float32", call.contiguous(q.shape), call.contiguous(k.shape),
                     call.contiguous(v.shape), causal=True)
    assert [(c["kernel"], c["grid"], c["arguments"][5]) for c in sim.CALLS] == [
        (plan.launches[p.launch].kernel, p.grid, p.params) for p in plan.pieces]
    # The knob gives each piece its own command buffer: a commit after each but the last.
    assert host.commits == list(range(1, len(plan.pieces)))
    np.testing.assert_array_equal(to_np(o), fa.attention(q, k, v, causal=True,
                                                         backend="metal-sim"))


def test_autograd_and_torch_compile_go_in_stream(host):
    case = Case(2, 40, 40, 4, 2, 32)
    q, k, v, do = inputs(case, seed=10)
    tq, tk, tv = (to_torch(x).requires_grad_() for x in (q, k, v))
    tdo = to_torch(do)

    def step(q, k, v):
        return (fat.attention(q, k, v, causal=True) * tdo).sum()

    step(tq, tk, tv).backward()
    kernels = {c["kernel"] for c in sim.CALLS}
    assert kernels == {"flash_fwd_f32_hd32", "flash_bwd_preprocess_f32", "flash_bwd_dq_f32_hd32",
                       "flash_bwd_dkdv_f32_hd32"}
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True, backend="metal-sim")
    want = fa.attention_backward(do, q, k, v, o, lse, causal=True, backend="metal-sim")
    for t, w in zip((tq, tk, tv), want):
        np.testing.assert_array_equal(t.grad.numpy(), w)
    cq, ck, cv = (to_torch(x).requires_grad_() for x in (q, k, v))
    sim.CALLS.clear()
    torch.compile(step, fullgraph=True, backend="aot_eager")(cq, ck, cv).backward()
    assert {c["kernel"] for c in sim.CALLS} == kernels
    for t, w in zip((cq, ck, cv), want):
        np.testing.assert_array_equal(t.grad.numpy(), w)


@pytest.mark.mac
@pytest.mark.skipif(not ON_MPS, reason="needs a Mac with PyTorch's MPS device and "
                                       "torch.mps.compile_shader (torch 2.7+)")
@pytest.mark.parametrize("tdtype", ["float32", "float16", "bfloat16"])
def test_mps_in_stream_equals_the_metal_engine(monkeypatch, tdtype):
    monkeypatch.setattr(torch_stream, "HOST", None)
    case = Case(2, 77, 130, 8, 2, 64)
    dt = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[tdtype]
    q, k, v, do = inputs(case, seed=5, dtype=dt)
    opts = options("all", case, np.random.default_rng(0))
    topts = {k: to_torch(v).to("mps") if isinstance(v, np.ndarray) else v
             for k, v in opts.items()}
    host = torch_stream.host(torch.device("mps"))
    assert host is not None
    mq, mk, mv, mdo = (to_torch(x).to("mps") for x in (q, k, v, do))
    o, lse = torch_stream.forward(host, mq, mk, mv, **topts)
    grads = torch_stream.backward(host, mdo, mq, mk, mv, o, lse, **topts)
    o_m, lse_m = fa.attention(q, k, v, return_lse=True, backend="metal", **opts)
    np.testing.assert_array_equal(to_np(o).view(np.uint8), o_m.view(np.uint8))
    np.testing.assert_array_equal(to_np(lse), lse_m)
    for got, want in zip(grads[:3], fa.attention_backward(do, q, k, v, o_m, lse_m,
                                                          backend="metal", **opts)):
        np.testing.assert_array_equal(to_np(got).view(np.uint8), want.view(np.uint8))
