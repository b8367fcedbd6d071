"""flashattn.torch: the output and gradients match torch's own
scaled_dot_product_attention by FlashAttention's rule, gradcheck passes in
float64 (on the reference), torch.compile traces the custom ops without a
graph break, layout="bhtd" is read without a copy, and errors name the
argument."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="flashattn.torch needs torch: pip install '.[torch]'")
F = torch.nn.functional

import flashattn.torch as fat  # noqa: E402
from framework_checks import (  # noqa: E402
    FORWARD_FACTOR,
    GRADIENT_FACTOR,
    assert_as_close_as,
    inputs,
    reference,
)

# (B, T, H, Hkv, D, causal); Tq == Tk so that SDPA's causal mask (top-left)
# is flashattn's (bottom-right).
CASES = [
    (2, 37, 4, 4, 16, False),
    (2, 64, 4, 2, 32, True),
    (1, 113, 6, 1, 59, True),
    (3, 29, 2, 2, 64, False),
]


def _torch_inputs(case, layout):
    B, T, H, Hkv, D, _ = case
    arrays = inputs(B, T, T, H, Hkv, D)
    tensors = [torch.from_numpy(a) for a in arrays]
    if layout == "bhtd":
        tensors = [t.transpose(1, 2).contiguous() for t in tensors]
    q, k, v, do = tensors
    return arrays, [t.requires_grad_() for t in (q, k, v)], do


def _bthd(t, layout):
    t = t.detach()
    return (t.transpose(1, 2) if layout == "bhtd" else t).numpy()


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_output_and_gradients_match_sdpa(case, layout):
    causal = case[-1]
    (q, k, v, do), (tq, tk, tv), tdo = _torch_inputs(case, layout)
    o = fat.attention(tq, tk, tv, causal=causal, layout=layout)
    grads = torch.autograd.grad(o, (tq, tk, tv), tdo)

    sq, sk, sv = (x if layout == "bhtd" else x.transpose(1, 2) for x in (tq, tk, tv))
    o_sdpa = F.scaled_dot_product_attention(sq, sk, sv, is_causal=causal, enable_gqa=True)
    if layout == "bthd":
        o_sdpa = o_sdpa.transpose(1, 2)
    grads_sdpa = torch.autograd.grad(o_sdpa, (tq, tk, tv), tdo)

    o64, grads64 = reference(q, k, v, do, causal=causal)
    assert o.shape == o_sdpa.shape and o.dtype == torch.float32
    assert_as_close_as("o", _bthd(o, layout), _bthd(o_sdpa, layout), o64, factor=FORWARD_FACTOR)
    for name, g, g_sdpa, g64 in zip(("dq", "dk", "dv"), grads, grads_sdpa, grads64):
        assert g.shape == g_sdpa.shape
        assert_as_close_as(name, _bthd(g, layout), _bthd(g_sdpa, layout), g64,
                           factor=GRADIENT_FACTOR)


def _plain_attention(q, k, v, causal):
    """Unfused float32 attention in torch, (B, H, T, D): FlashAttention's own
    test baseline (attention_ref without upcasting)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def test_longer_gqa_gradients_within_flashattentions_rule():
    # At T = 256 torch's fused CPU SDPA accumulates dv more accurately than a
    # plain float32 implementation (and than flashattn's cpu engine, by 3-4x),
    # so here the baseline is FlashAttention's own: the plain float32 math.
    (q, k, v, do), (tq, tk, tv), tdo = _torch_inputs((2, 256, 8, 2, 64, True), "bhtd")
    o = fat.attention(tq, tk, tv, causal=True, layout="bhtd")
    grads = torch.autograd.grad(o, (tq, tk, tv), tdo)
    o_plain = _plain_attention(tq, tk, tv, causal=True)
    grads_plain = torch.autograd.grad(o_plain, (tq, tk, tv), tdo)
    o64, grads64 = reference(q, k, v, do, causal=True)
    assert_as_close_as("o", _bthd(o, "bhtd"), _bthd(o_plain, "bhtd"), o64,
                       factor=FORWARD_FACTOR)
    for name, g, g_plain, g64 in zip(("dq", "dk", "dv"), grads, grads_plain, grads64):
        assert_as_close_as(name, _bthd(g, "bhtd"), _bthd(g_plain, "bhtd"), g64,
                           factor=GRADIENT_FACTOR)


@pytest.mark.parametrize("opts", [dict(causal=False), dict(causal=True),
                                  dict(causal=True, window=(2, 0)), dict(window=(1, 2)),
                                  dict(scale=0.3)], ids=str)
def test_gradcheck_in_float64_on_the_reference(opts):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, 6, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, 6, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: fat.attention(q, k, v, **opts), (q, k, v))
    bh = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: fat.attention(q, k, v, layout="bhtd", **opts), bh)


def test_window_gradients_match_the_reference():
    (q, k, v, do), (tq, tk, tv), tdo = _torch_inputs((1, 50, 4, 2, 16, True), "bthd")
    o = fat.attention(tq, tk, tv, causal=True, window=(7, 0))
    grads = torch.autograd.grad(o, (tq, tk, tv), tdo)
    o64, grads64 = reference(q, k, v, do, causal=True, window=(7, 0))
    np.testing.assert_allclose(o.detach().numpy(), o64, atol=1e-5)
    for g, g64 in zip(grads, grads64):
        np.testing.assert_allclose(g.numpy(), g64, atol=1e-4)


def test_torch_compile_traces_without_graph_breaks():
    (_, _, _, _), (tq, tk, tv), tdo = _torch_inputs((2, 40, 4, 2, 16, True), "bhtd")

    def step(q, k, v):
        return (fat.attention(q, k, v, causal=True, layout="bhtd") * tdo).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(tq, tk, tv)
    grads = torch.autograd.grad(loss, (tq, tk, tv))
    eager = torch.autograd.grad(step(tq, tk, tv), (tq, tk, tv))
    assert torch.equal(loss, step(tq, tk, tv))
    for g, e in zip(grads, eager):
        assert torch.equal(g, e)


# Inductor's own start-up calls torch.jit APIs that warn about their deprecation.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_with_inductor_matches_eager():
    (_, _, _, _), (tq, tk, tv), tdo = _torch_inputs((2, 40, 4, 2, 16, True), "bhtd")

    def step(q, k, v):
        return (fat.attention(q, k, v, causal=True, layout="bhtd") ** 2).sum()

    loss = torch.compile(step, fullgraph=True)(tq, tk, tv)
    grads = torch.autograd.grad(loss, (tq, tk, tv))
    eager = torch.autograd.grad(step(tq, tk, tv), (tq, tk, tv))
    for g, e in zip(grads, eager):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_custom_ops_pass_opcheck():
    (_, _, _, _), (tq, tk, tv), tdo = _torch_inputs((1, 9, 2, 1, 8, True), "bthd")
    torch.library.opcheck(torch.ops.flashattn.attention.default,
                          (tq, tk, tv, True, -1, -1, None, None))
    o, lse = torch.ops.flashattn.attention(tq, tk, tv, True, -1, -1, None, None)
    torch.library.opcheck(torch.ops.flashattn.attention_backward.default,
                          (tdo, tq.detach(), tk.detach(), tv.detach(), o.detach(), lse, True, -1,
                           -1, None, None))


def test_bhtd_layout_and_strided_gradients_are_not_copied(monkeypatch):
    import flashattn._api as api

    def no_copy(x):
        raise AssertionError(f"an input of shape {x.shape}, strides {x.strides} was copied")

    monkeypatch.setattr(api, "_contiguous_copy", no_copy)
    (_, _, _, _), (tq, tk, tv), tdo = _torch_inputs((2, 33, 4, 2, 16, True), "bhtd")
    o = fat.attention(tq, tk, tv, causal=True, layout="bhtd")
    assert o.shape == tq.shape
    o.backward(tdo)
    assert tq.grad.shape == tq.shape


def test_cpu_inputs_are_read_in_place():
    import flashattn._arrays as arrays

    q = torch.randn(2, 8, 4, 16)
    assert arrays.host_array("f", "q", q).ctypes.data == q.data_ptr()
    view = torch.randn(2, 4, 8, 16).transpose(1, 2)
    assert arrays.host_array("f", "q", view).ctypes.data == view.data_ptr()


def test_the_gil_is_released_while_the_engine_runs(restore_threads):
    import flashattn as fa
    from test_concurrency import _main_thread_ticks_inside

    fa.set_num_threads(1)  # leave a core for this thread
    (_, _, _, _), (tq, tk, tv), tdo = _torch_inputs((1, 1024, 4, 4, 64, False), "bhtd")
    o = fat.attention(tq, tk, tv, layout="bhtd")
    ticks, d = _main_thread_ticks_inside(lambda: fat.attention(tq, tk, tv, layout="bhtd"))
    assert ticks > 0, f"forward ({d * 1e3:.0f} ms) held the GIL"
    ticks, d = _main_thread_ticks_inside(lambda: torch.autograd.grad(o, (tq, tk, tv), tdo,
                                                                     retain_graph=True))
    assert ticks > 0, f"backward ({d * 1e3:.0f} ms) held the GIL"


def test_errors_name_the_argument():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match=r"^flashattn.torch.attention: k must be float32"):
        fat.attention(q, q.half(), q)
    with pytest.raises(TypeError, match=r"^flashattn.torch.attention: v must be a torch.Tensor"):
        fat.attention(q, q, q.numpy())
    with pytest.raises(ValueError, match=r"^flashattn.torch.attention: layout must be"):
        fat.attention(q, q, q, layout="bsnd")
    with pytest.raises(ValueError, match=r"^flashattn.torch.attention: unknown backend 'cuda'"):
        fat.attention(q, q, q, backend="cuda")
    with pytest.raises(ValueError, match=r"^flashattn.torch.attention: window"):
        fat.attention(q, q, q, window=3)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions"):
        fat.attention(q[0], q, q)


def test_the_numpy_api_points_a_tensor_that_requires_grad_to_flashattn_torch():
    import flashattn as fa

    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    with pytest.raises(TypeError, match=r"^attention: q .*requires grad.*flashattn\.torch"):
        fa.attention(q, q.detach(), q.detach())


@pytest.mark.mac
@pytest.mark.skipif(not torch.backends.mps.is_available(),
                    reason="needs a Mac with PyTorch's MPS device")
def test_mps_tensors_match_cpu_tensors():
    (_, _, _, _), (tq, tk, tv), tdo = _torch_inputs((1, 64, 4, 2, 32, True), "bhtd")
    mq, mk, mv = (t.detach().to("mps").requires_grad_() for t in (tq, tk, tv))
    o = fat.attention(mq, mk, mv, causal=True, layout="bhtd")
    assert o.device.type == "mps"
    o.backward(tdo.to("mps"))
    o_cpu = fat.attention(tq, tk, tv, causal=True, layout="bhtd")
    o_cpu.backward(tdo)
    torch.testing.assert_close(o.cpu(), o_cpu.detach(), atol=1e-4, rtol=1e-4)
    for m, c in zip((mq, mk, mv), (tq, tk, tv)):
        torch.testing.assert_close(m.grad.cpu(), c.grad, atol=1e-4, rtol=1e-4)
