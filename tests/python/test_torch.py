"""flashattn.torch: every dtype and option against torch's own math in
float64 (forward, lse and every gradient, sinks included), by
FlashAttention's rule (framework_checks.py); varlen the same; gradcheck in
float64; torch.compile(fullgraph=True) traces every op without a graph
break; the drop-in scaled_dot_product_attention against
torch.nn.functional.scaled_dot_product_attention itself; layout="bhtd" is
read without a copy; errors name the argument."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="flashattn.torch needs torch: pip install '.[torch]'")
F = torch.nn.functional

import flashattn.torch as fat  # noqa: E402
from framework_checks import (  # noqa: E402
    FORWARD_FACTOR,
    GRADIENT_FACTOR,
    OPTION_SETS,
    VARLEN_CU_K,
    VARLEN_CU_Q,
    Ops,
    assert_within_rule,
    make,
    make_varlen,
    plain_attention,
    plain_varlen,
    record_drop_in,
)

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
OPS = Ops(einsum=torch.einsum, where=torch.where, exp=torch.exp, log=torch.log, tanh=torch.tanh,
          maximum=torch.maximum, repeat=lambda x, n, axis: x.repeat_interleave(n, dim=axis),
          max_last=lambda x: x.amax(-1, keepdim=True), sum_last=lambda x: x.sum(-1, keepdim=True),
          constant=lambda a, like: torch.as_tensor(a, dtype=torch.bool if like is True
                                                    else like.dtype))


def _options(options: dict, dtype) -> dict:
    """NumPy options as tensors: arrays float32 (``dtype`` for the plain
    math), bool kept; sinks requires grad."""
    out = {}
    for name, x in options.items():
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x) if x.dtype == np.bool_ else torch.from_numpy(x).to(dtype)
            if name == "sinks":
                x.requires_grad_()
        out[name] = x
    return out


def _inputs(arrays: dict, dtype, layout="bthd"):
    q, k, v, do = (torch.from_numpy(arrays[n]).to(dtype) for n in ("q", "k", "v", "do"))
    if layout == "bhtd":
        q, k, v, do = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    return [x.requires_grad_() for x in (q, k, v)], do


def _numpy(t, layout="bthd"):
    t = t.detach().double()
    return (t.transpose(1, 2) if layout == "bhtd" and t.dim() == 4 else t).numpy()


def _plain(arrays, options, dtype, *, varlen=False, rounded=None):
    """o, lse and the gradients of the plain math in ``dtype``, the
    gradients' delta from o rounded to ``rounded`` (framework_checks)."""
    (q, k, v), do = _inputs(arrays, dtype)
    opts = _options(options, dtype)
    if varlen:
        o, lse = plain_varlen(OPS, torch.cat, q, k, v, VARLEN_CU_Q, VARLEN_CU_K, **opts)
    else:
        o, lse = plain_attention(OPS, q, k, v, **opts)
    c = torch.zeros_like(lse)
    if rounded is not None:
        c = (do * (o - o.to(rounded).to(dtype))).sum(-1).detach()
        c = c.transpose(-1, -2) if varlen else c.transpose(1, 2)  # as lse: (.., H, Tq)
    wrt = [q, k, v] + ([opts["sinks"]] if "sinks" in opts else [])
    grads = torch.autograd.grad((o, lse), wrt, (do, c))
    return [x.detach().double().numpy() for x in (o, lse, *grads)]


def _check(ours, arrays, options, dtype, *, varlen=False):
    truth = _plain(arrays, options, torch.float64, varlen=varlen)
    yardstick = _plain(arrays, options, torch.float32, varlen=varlen, rounded=DTYPES[dtype])
    magnitude = max(float(np.abs(t).max(initial=0)) for t in truth[2:5])
    for i, name in enumerate(["o", "lse", "dq", "dk", "dv", "dsinks"][:len(ours)]):
        gradient = i >= 2
        assert_within_rule(name, ours[i], yardstick[i], truth[i], dtype=dtype,
                           factor=GRADIENT_FACTOR if gradient else FORWARD_FACTOR,
                           magnitude=magnitude if 2 <= i <= 4 else None,
                           out_dtype="f32" if name in ("lse", "dsinks") else None)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("option_set", OPTION_SETS)
def test_attention_matches_torch_math(option_set, dt):
    dtype = dt
    _, arrays, options = make(option_set, dtype)
    layout = "bhtd" if option_set in ("window-scale", "everything") else "bthd"
    (q, k, v), do = _inputs(arrays, DTYPES[dtype], layout)
    opts = _options(options, torch.float32)
    o, lse = fat.attention(q, k, v, return_lse=True, layout=layout, **opts)
    assert o.dtype == DTYPES[dtype] and o.shape == q.shape and lse.dtype == torch.float32
    assert not lse.requires_grad
    wrt = [q, k, v] + ([opts["sinks"]] if "sinks" in opts else [])
    grads = torch.autograd.grad(o, wrt, do)
    assert [g.dtype for g in grads[:3]] == [DTYPES[dtype]] * 3
    _check([_numpy(x, layout) for x in (o, lse, *grads)], arrays, options, dtype)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_attention_varlen_matches_torch_math(dt):
    dtype = dt
    arrays, options = make_varlen(dtype)
    (q, k, v), do = _inputs(arrays, DTYPES[dtype])
    opts = _options(options, torch.float32)
    cu_q, cu_k = torch.from_numpy(VARLEN_CU_Q), torch.from_numpy(VARLEN_CU_K).long()  # int64 too
    o, lse = fat.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    grads = torch.autograd.grad(o, [q, k, v, opts["sinks"]], do)
    _check([_numpy(x) for x in (o, lse, *grads)], arrays, options, dtype, varlen=True)


@pytest.mark.parametrize("opts", [dict(causal=True, window=(2, 0)), dict(window=(1, 2), scale=0.3),
                                  dict(softcap=2.0, alibi=True, mask=True, sinks=True)], ids=str)
def test_gradcheck_in_float64_on_the_reference(opts):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, 6, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, 6, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    sinks = torch.randn(4, dtype=torch.float64, generator=gen, requires_grad=True)
    extra = {}
    if opts.pop("alibi", False):
        extra["alibi_slopes"] = torch.rand(4, dtype=torch.float64, generator=gen)
    if opts.pop("mask", False):
        extra["mask"] = torch.rand(1, 4, 5, 6, generator=gen) > 0.3
    if opts.pop("sinks", False):
        assert torch.autograd.gradcheck(
            lambda q, k, v, s: fat.attention(q, k, v, sinks=s, **opts, **extra), (q, k, v, sinks))
    assert torch.autograd.gradcheck(lambda q, k, v: fat.attention(q, k, v, **opts, **extra),
                                    (q, k, v))
    bh = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: fat.attention(q, k, v, layout="bhtd", **opts, **extra), bh)


def _compiled_step(dtype):
    _, arrays, options = make("everything", "bf16" if dtype == torch.bfloat16 else "f32", seed=4)
    (q, k, v), do = _inputs(arrays, dtype, "bhtd")
    opts = _options(options, torch.float32)
    cu_q, cu_k = torch.tensor([0, 5, 13], dtype=torch.int32), torch.tensor([0, 20, 29])

    def step(q, k, v, sinks):
        o = fat.attention(q, k, v, layout="bhtd", **dict(opts, sinks=sinks))
        packed = [x[0].transpose(0, 1) for x in (q, k, v)]
        o2 = fat.attention_varlen(*packed, cu_q, cu_k, causal=True, softcap=2.0, sinks=sinks)
        return (o.float() * do.float()).sum() + (o2.float() ** 2).sum()

    return step, (q, k, v, opts["sinks"])


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torch_compile_fullgraph_matches_eager_bit_for_bit(dt):
    step, args = _compiled_step(dt)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(*args)
    grads = torch.autograd.grad(loss, args)
    eager = step(*args)
    assert torch.equal(loss, eager)
    for g, e in zip(grads, torch.autograd.grad(eager, args)):
        assert torch.equal(g, e)


# Inductor's own start-up calls torch.jit APIs that warn about their deprecation.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_with_inductor_matches_eager():
    step, args = _compiled_step(torch.float32)
    loss = torch.compile(step, fullgraph=True)(*args)
    for g, e in zip(torch.autograd.grad(loss, args), torch.autograd.grad(step(*args), args)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


# torch 2.14's opcheck reads .grad of every tensor argument while it fakes
# them (torch/_subclasses/meta_utils.py safe_grad), and hides the warning a
# non-leaf's .grad raises with its own filter, which pytest's "error" filter
# (pyproject.toml) overrides: the warning is torch's, not the op's.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_custom_ops_pass_opcheck():
    _, arrays, options = make("everything", "bf16", seed=2)
    (q, k, v), do = _inputs(arrays, torch.bfloat16)
    opts = _options(options, torch.float32)
    alibi, mask, sinks = opts["alibi_slopes"], opts["mask"], opts["sinks"].detach()
    args = (q, k, v, True, 9, 0, 0.2, 3.0, alibi, mask, sinks, None)
    torch.library.opcheck(torch.ops.flashattn.attention.default, args)
    o, lse = torch.ops.flashattn.attention(*args)
    torch.library.opcheck(torch.ops.flashattn.attention_backward.default,
                          (do, q.detach(), k.detach(), v.detach(), o.detach(), lse, True, 9, 0,
                           0.2, 3.0, alibi, mask, sinks, None))
    packed = [x.detach()[0] for x in (q, k, v)]
    cu = torch.tensor([0, 4, 13], dtype=torch.int32), torch.tensor([0, 10, 29], dtype=torch.int32)
    vargs = (*packed, *cu, True, -1, -1, None, 0.0, None, sinks, None)
    torch.library.opcheck(torch.ops.flashattn.attention_varlen.default, vargs)
    o, lse = torch.ops.flashattn.attention_varlen(*vargs)
    torch.library.opcheck(torch.ops.flashattn.attention_varlen_backward.default,
                          (packed[0], *packed, o, lse, *cu, True, -1, -1, None, 0.0, None, sinks,
                           None))


def test_bhtd_layout_and_strided_gradients_are_not_copied(monkeypatch):
    import flashattn._api as api

    def no_copy(x):
        raise AssertionError(f"an input of shape {x.shape}, strides {x.strides} was copied")

    monkeypatch.setattr(api, "_contiguous_copy", no_copy)
    for dtype in ("f32", "bf16"):
        _, arrays, _ = make("plain", dtype)
        (q, k, v), do = _inputs(arrays, DTYPES[dtype], "bhtd")
        o = fat.attention(q, k, v, causal=True, layout="bhtd")
        assert o.shape == q.shape
        o.backward(do)
        assert q.grad.shape == q.shape


def test_cpu_inputs_are_read_in_place():
    import flashattn._arrays as arrays

    for dtype in DTYPES.values():
        q = torch.randn(2, 8, 4, 16).to(dtype)
        assert arrays.host_array("f", "q", q).ctypes.data == q.data_ptr()
        view = torch.randn(2, 4, 8, 16).to(dtype).transpose(1, 2)
        assert arrays.host_array("f", "q", view).ctypes.data == view.data_ptr()


def test_the_gil_is_released_while_the_engine_runs(restore_threads):
    import flashattn as fa
    from test_concurrency import _main_thread_ticks_inside

    fa.set_num_threads(1)  # leave a core for this thread
    q, k, v = (torch.randn(1, 4, 1024, 64, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 4, 1024, 64)
    o = fat.attention(q, k, v, layout="bhtd")
    ticks, d = _main_thread_ticks_inside(lambda: fat.attention(q, k, v, layout="bhtd"))
    assert ticks > 0, f"forward ({d * 1e3:.0f} ms) held the GIL"
    ticks, d = _main_thread_ticks_inside(lambda: torch.autograd.grad(o, (q, k, v), do,
                                                                     retain_graph=True))
    assert ticks > 0, f"backward ({d * 1e3:.0f} ms) held the GIL"


# ---- The drop-in: flashattn.torch.scaled_dot_product_attention ------------------------

# (name, query shape, key shape, value shape, keyword arguments; "mask": a
# bool or float mask of that shape is drawn)
SDPA_CASES = [
    ("causal-gqa", (2, 6, 17, 16), (2, 2, 17, 16), (2, 2, 17, 16),
     dict(is_causal=True, enable_gqa=True)),
    ("causal-Tq<Tk", (2, 4, 9, 16), (2, 4, 23, 16), (2, 4, 23, 16), dict(is_causal=True)),
    ("causal-Tq>Tk", (1, 4, 23, 8), (1, 4, 9, 8), (1, 4, 9, 8), dict(is_causal=True)),
    ("bool-mask-2d", (2, 4, 11, 16), (2, 4, 19, 16), (2, 4, 19, 16),
     dict(mask=("bool", (11, 19)))),
    ("float-mask-scale", (2, 4, 11, 32), (2, 4, 19, 32), (2, 4, 19, 32),
     dict(mask=("float", (2, 1, 11, 19)), scale=0.3)),
    ("3d", (4, 13, 16), (4, 13, 16), (4, 13, 16), dict(is_causal=True)),
    ("5d-broadcast-batch", (2, 3, 4, 7, 8), (1, 3, 4, 12, 8), (1, 3, 4, 12, 8),
     dict(mask=("bool", (3, 1, 7, 12)))),
    ("Ev!=E", (2, 4, 9, 16), (2, 4, 9, 16), (2, 4, 9, 24), dict(is_causal=True)),
    ("mqa-broadcast-heads", (2, 4, 9, 16), (2, 1, 13, 16), (2, 1, 13, 16), {}),
]


def _sdpa_inputs(case, dtype, seed=0):
    _, qs, ks, vs, kwargs = case
    rng = np.random.default_rng(seed)
    q, k, v = (torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to(dtype)
               for s in (qs, ks, vs))
    kwargs = dict(kwargs)
    if "mask" in kwargs:
        kind, shape = kwargs.pop("mask")
        m = rng.random(shape) > 0.25
        kwargs["attn_mask"] = (torch.from_numpy(m) if kind == "bool" else
                               torch.from_numpy(np.where(m, rng.standard_normal(shape), -np.inf))
                               .to(dtype))
    do = torch.from_numpy(rng.standard_normal(qs[:-1] + vs[-1:], dtype=np.float32)).to(dtype)
    return q, k, v, do, kwargs


def _sdpa_run(fn, q, k, v, do, kwargs, dtype):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    kwargs = {n: (x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
              for n, x in kwargs.items()}
    o = fn(q, k, v, **kwargs)
    return [x.detach().double().numpy() for x in (o, *torch.autograd.grad(o, (q, k, v),
                                                                           do.to(dtype)))]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("case", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_drop_in_matches_torch_sdpa(case, dt):
    dtype = dt
    q, k, v, do, kwargs = _sdpa_inputs(case, DTYPES[dtype])
    ours = _sdpa_run(fat.scaled_dot_product_attention, q, k, v, do, kwargs, DTYPES[dtype])
    theirs = _sdpa_run(F.scaled_dot_product_attention, q, k, v, do, kwargs, DTYPES[dtype])
    truth = _sdpa_run(F.scaled_dot_product_attention, q, k, v, do, kwargs, torch.float64)
    assert ours[0].shape == theirs[0].shape
    magnitude = max(float(np.abs(t).max()) for t in truth[1:])
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        record_drop_in(f"torch sdpa {name}", dtype, ours[i], theirs[i])
        assert_within_rule(name, ours[i], theirs[i], truth[i], dtype=dtype,
                           factor=FORWARD_FACTOR if i == 0 else GRADIENT_FACTOR,
                           magnitude=None if i == 0 else magnitude)


def test_sdpa_drop_in_refuses_dropout_and_masks_that_need_gradients():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(NotImplementedError, match=r"^flashattn.torch.scaled_dot_product_attention: "
                                                  r"dropout \(dropout_p=0.1\) is not implemented"):
        fat.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(RuntimeError, match=r"mask requires grad.*pass mask.detach\(\)"):
        fat.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(5, 5, requires_grad=True))
    with pytest.raises(ValueError, match=r"attn_mask and is_causal=True were both given"):
        fat.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool),
                                         is_causal=True)
    with pytest.raises(ValueError, match=r"query has 4 heads and key 2: use enable_gqa=True"):
        fat.scaled_dot_product_attention(torch.randn(1, 4, 5, 8), q, q)
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got str 'False'"):
        fat.scaled_dot_product_attention(q, q, q, is_causal="False")


# ---- Errors -------------------------------------------------------------------------

def test_errors_name_the_argument():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match=r"^flashattn.torch.attention: q, k and v must share one "
                                        r"dtype; q is torch.float32, k is torch.float16"):
        fat.attention(q, q.half(), q)
    with pytest.raises(TypeError, match=r"^flashattn.torch.attention: k must be float32, float16 "
                                        r"or bfloat16"):
        fat.attention(q, q.int(), q)
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
    with pytest.raises(ValueError, match=r"^flashattn.torch.attention: sinks must have shape "
                                         r"\(H,\) = \(2,\), got \(3,\)"):
        fat.attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match=r"^flashattn.torch.attention: alibi_slopes must be "
                                        r"float32"):
        fat.attention(q, q, q, alibi_slopes=torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^flashattn.torch.attention: mask must be "
                                         r"broadcastable to \(B, H, Tq, Tk\) = \(1, 2, 4, 4\), "
                                         r"got shape \(3, 4\)"):
        fat.attention(q, q, q, mask=torch.ones(3, 4, dtype=torch.bool))


@pytest.mark.parametrize("name", ["mask", "alibi_slopes"])
def test_a_mask_or_slopes_that_require_grad_are_refused(name):
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    option = torch.zeros((1, 2, 4, 4) if name == "mask" else (2,), requires_grad=True)
    with pytest.raises(RuntimeError, match=rf"^flashattn.torch.attention: {name} requires grad, "
                                           rf"and flashattn computes no gradient for it"):
        fat.attention(q, q, q, **{name: option})
    with torch.no_grad():  # nothing to differentiate: taken
        fat.attention(q, q, q, **{name: option})
    args = [q, q, q, False, -1, -1, None, 0.0, None, None, None, None]
    args[8 if name == "alibi_slopes" else 9] = option
    o, _ = torch.ops.flashattn.attention(*args)  # the op itself refuses in its backward
    with pytest.raises(RuntimeError, match=rf"{name} requires grad"):
        o.sum().backward()


def test_causal_must_be_a_bool_in_every_entry_point():
    # issue 32, item 12: "False" (a str) ran causal attention before.
    q = torch.randn(1, 4, 2, 8)
    for call in (lambda: fat.attention(q, q, q, causal="False"),
                 lambda: fat.attention_varlen(q[0], q[0], q[0], torch.tensor([0, 4]),
                                              torch.tensor([0, 4]), causal="False"),
                 lambda: fat.attention(q, q, q, return_lse="True")):
        with pytest.raises(TypeError, match=r"^flashattn.torch.attention(_varlen)?: "
                                            r"(causal|return_lse) must be a bool, got str"):
            call()


def test_the_numpy_api_points_a_tensor_that_requires_grad_to_flashattn_torch():
    import flashattn as fa

    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    with pytest.raises(TypeError, match=r"^attention: q .*requires grad.*flashattn\.torch"):
        fa.attention(q, q.detach(), q.detach())


@pytest.mark.mac
@pytest.mark.skipif(not torch.backends.mps.is_available(),
                    reason="needs a Mac with PyTorch's MPS device")
def test_mps_tensors_match_cpu_tensors():
    _, arrays, options = make("everything", "f32")
    (tq, tk, tv), tdo = _inputs(arrays, torch.float32, "bhtd")
    opts = _options(options, torch.float32)
    mq, mk, mv = (t.detach().to("mps").requires_grad_() for t in (tq, tk, tv))
    mopts = {n: x.detach().to("mps") if isinstance(x, torch.Tensor) else x for n, x in opts.items()}
    o = fat.attention(mq, mk, mv, layout="bhtd", **mopts)
    assert o.device.type == "mps"
    o.backward(tdo.to("mps"))
    o_cpu = fat.attention(tq, tk, tv, layout="bhtd", **opts)
    o_cpu.backward(tdo)
    torch.testing.assert_close(o.cpu(), o_cpu.detach(), atol=1e-4, rtol=1e-4)
    for m, c in zip((mq, mk, mv), (tq, tk, tv)):
        torch.testing.assert_close(m.grad.cpu(), c.grad, atol=1e-4, rtol=1e-4)
