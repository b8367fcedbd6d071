"""flashattn.mlx: every dtype and option against MLX's own math in float64
(forward, lse and every gradient: q, k, v and sinks by the fused backward,
an additive mask and ALiBi slopes by MLX's math), by FlashAttention's rule
(framework_checks.py); varlen the same; the drop-in
scaled_dot_product_attention against mx.fast.scaled_dot_product_attention
itself; errors name the argument."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="flashattn.mlx needs mlx: pip install '.[mlx]'")

import flashattn as fa  # noqa: E402
import flashattn.mlx as fam  # noqa: E402
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

DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
OPS = Ops(einsum=mx.einsum, where=mx.where, exp=mx.exp, log=mx.log, tanh=mx.tanh,
          maximum=mx.maximum, repeat=lambda x, n, axis: mx.repeat(x, n, axis=axis),
          max_last=lambda x: mx.max(x, axis=-1, keepdims=True),
          sum_last=lambda x: mx.sum(x, axis=-1, keepdims=True),
          constant=lambda a, like: mx.array(a, dtype=mx.bool_ if like is True else like.dtype))

# The option arrays that get a gradient, in the order the checks name them.
DIFFERENTIABLE = ("sinks", "alibi_slopes", "mask")


def _array(x: np.ndarray, dtype):
    return mx.array(x) if x.dtype == np.bool_ else mx.array(x.astype(np.float32)).astype(dtype)


def _numpy(x) -> np.ndarray:
    return np.array(x.astype(mx.float64) if x.dtype != mx.float64 else x, dtype=np.float64)


def _split(options: dict, dtype):
    """(static options, {name: array} of the differentiable ones, in order)."""
    static = {n: (_array(x, dtype) if isinstance(x, np.ndarray) else x)
              for n, x in options.items()}
    diff = {n: static.pop(n) for n in DIFFERENTIABLE
            if n in static and not (n == "mask" and static[n].dtype == mx.bool_)}
    return static, diff


def _plain(arrays, options, dtype, *, varlen=False, rounded=None):
    """o, lse and the gradients (q, k, v, then the differentiable options) of
    MLX's plain math in ``dtype``, the gradients' delta from o rounded to
    ``rounded`` (framework_checks)."""
    q, k, v, do = (_array(arrays[n], dtype) for n in ("q", "k", "v", "do"))
    static, diff = _split(options, dtype)

    def f(q, k, v, *extras):
        opts = dict(static, **dict(zip(diff, extras)))
        if varlen:
            return list(plain_varlen(OPS, mx.concatenate, q, k, v, VARLEN_CU_Q, VARLEN_CU_K,
                                     **opts))
        return list(plain_attention(OPS, q, k, v, **opts))

    primals = [q, k, v, *diff.values()]
    o, lse = f(*primals)
    c = mx.zeros_like(lse)
    if rounded is not None:
        c = mx.sum(do * (o - o.astype(rounded).astype(dtype)), axis=-1)
        c = c.T if varlen else c.swapaxes(1, 2)
    (o, lse), grads = mx.vjp(f, primals, [do, c])
    return [_numpy(x) for x in (o, lse, *grads)]


def _check(ours, arrays, options, dtype, *, varlen=False):
    truth = _plain(arrays, options, mx.float64, varlen=varlen)
    yardstick = _plain(arrays, options, mx.float32, varlen=varlen, rounded=DTYPES[dtype])
    _, diff = _split(options, mx.float32)
    names = ["o", "lse", "dq", "dk", "dv"] + [f"d{n}" for n in diff]
    assert len(ours) == len(truth) == len(names)
    magnitude = max(float(np.abs(t).max(initial=0)) for t in truth[2:5])
    for i, name in enumerate(names):
        assert_within_rule(name, ours[i], yardstick[i], truth[i], dtype=dtype,
                           factor=GRADIENT_FACTOR if i >= 2 else FORWARD_FACTOR,
                           magnitude=magnitude if 2 <= i <= 4 else None,
                           out_dtype="f32" if i == 1 or i >= 5 else None)


def _ours(attend, arrays, options, dt, layout="bthd"):
    q, k, v, do = (_array(arrays[n], DTYPES[dt]) for n in ("q", "k", "v", "do"))
    if layout == "bhtd":
        q, k, v, do = (x.swapaxes(1, 2) for x in (q, k, v, do))
    static, diff = _split(options, mx.float32)

    def loss(q, k, v, *extras):
        o, lse = attend(q, k, v, **static, **dict(zip(diff, extras)))
        return (o.astype(mx.float32) * do.astype(mx.float32)).sum(), o, lse

    primals = [q, k, v, *diff.values()]
    (_, o, lse), grads = mx.value_and_grad(loss, argnums=list(range(len(primals))))(*primals)
    assert o.dtype == DTYPES[dt] and o.shape == q.shape and lse.dtype == mx.float32
    assert [g.dtype for g in grads[:3]] == [DTYPES[dt]] * 3
    out = [o, lse, *grads]
    if layout == "bhtd":
        out = [x.swapaxes(1, 2) if x.ndim == 4 and i != 1 and i < 5 else x
               for i, x in enumerate(out)]
    return [_numpy(x) for x in out]


# Every option set in every dtype (MLX's math runs eagerly and fast here).
MATH_CASES = [(o, dt) for dt in DTYPES for o in OPTION_SETS]


@pytest.mark.parametrize("option_set,dt", MATH_CASES, ids=[f"{o}-{d}" for o, d in MATH_CASES])
def test_attention_matches_mlx_math(option_set, dt):
    _, arrays, options = make(option_set, dt)
    layout = "bhtd" if option_set in ("window-scale", "everything") else "bthd"
    ours = _ours(lambda q, k, v, **kw: fam.attention(q, k, v, return_lse=True, layout=layout,
                                                     **kw), arrays, options, dt, layout)
    _check(ours, arrays, options, dt)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_attention_varlen_matches_mlx_math(dt):
    arrays, options = make_varlen(dt)
    cu_q, cu_k = mx.array(VARLEN_CU_Q), VARLEN_CU_K.astype(np.int64)  # int64 NumPy too
    ours = _ours(lambda q, k, v, **kw: fam.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True,
                                                            **kw), arrays, options, dt)
    _check(ours, arrays, options, dt, varlen=True)


def test_same_results_as_the_numpy_api_bit_for_bit():
    _, arrays, options = make("everything", "bf16", seed=1)
    q, k, v, do = (_array(arrays[n], mx.bfloat16) for n in ("q", "k", "v", "do"))
    static, diff = _split(options, mx.float32)
    o = fam.attention(q, k, v, backend="cpu", **static, **diff)
    grads = mx.grad(lambda q, k, v, s: (fam.attention(q, k, v, backend="cpu", sinks=s,
                                                      **static, alibi_slopes=diff["alibi_slopes"],
                                                      mask=diff["mask"]).astype(mx.float32)
                                        * do.astype(mx.float32)).sum(),
                    argnums=(0, 1, 2, 3))(q, k, v, diff["sinks"])
    # The NumPy API reads MLX arrays (bfloat16 too) in place.
    o_np, lse = fa.attention(q, k, v, return_lse=True, backend="cpu", **options)
    np.testing.assert_array_equal(_numpy(o), o_np.astype(np.float64))
    want = fa.attention_backward(do, q, k, v, o_np, lse, backend="cpu", **options)
    for g, w in zip(grads, want):
        np.testing.assert_array_equal(_numpy(g), np.asarray(w, np.float64))


# ---- The drop-in: flashattn.mlx.scaled_dot_product_attention ---------------------------

# (name, q shape (B, N, T, D), k shape, keyword arguments; "mask": a bool or
# float mask of that shape is drawn, "rows": some rows see no key)
SDPA_CASES = [
    ("causal-gqa", (2, 6, 17, 16), (2, 2, 17, 16), dict(mask="causal")),
    ("causal-Tq<Tk", (2, 4, 9, 16), (2, 4, 23, 16), dict(mask="causal")),
    ("causal-Tq>Tk", (1, 4, 23, 8), (1, 4, 9, 8), dict(mask="causal")),
    ("bool-mask-2d", (2, 4, 11, 16), (2, 4, 19, 16), dict(mask=("bool", (11, 19)))),
    ("float-mask-sinks", (2, 4, 11, 32), (2, 2, 19, 32), dict(mask=("float", (2, 1, 11, 19)),
                                                             sinks=True)),
    ("fully-masked-rows", (2, 2, 9, 16), (2, 2, 12, 16), dict(mask=("bool", (2, 2, 9, 12)),
                                                              rows=True)),
]


def _sdpa_inputs(case, seed=0):
    _, qs, ks, kwargs = case
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in (qs, ks, ks))
    do = rng.standard_normal(qs, dtype=np.float32)
    kwargs = dict(kwargs, scale=1 / np.sqrt(qs[-1]))
    rows = kwargs.pop("rows", False)
    if isinstance(kwargs.get("mask"), tuple):
        kind, shape = kwargs["mask"]
        m = rng.random(shape) > 0.25
        if rows:
            m[..., 3, :] = False
        kwargs["mask"] = m if kind == "bool" else np.where(m, rng.standard_normal(shape),
                                                           -np.inf).astype(np.float32)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = rng.standard_normal(qs[1]).astype(np.float32)
    return q, k, v, do, kwargs


def _sdpa_run(fn, q, k, v, do, kwargs, dtype):
    q, k, v, do = (mx.array(x).astype(dtype) for x in (q, k, v, do))
    kw = {n: (mx.array(x) if x.dtype == np.bool_ else mx.array(x).astype(dtype))
          if isinstance(x, np.ndarray) else x for n, x in kwargs.items()}
    (o,), grads = mx.vjp(lambda q, k, v: [fn(q, k, v, **kw)], [q, k, v], [do])
    return [_numpy(x) for x in (o, *grads)]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("case", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_drop_in_matches_mlx_sdpa(case, dt):
    q, k, v, do, kwargs = _sdpa_inputs(case)
    ours = _sdpa_run(fam.scaled_dot_product_attention, q, k, v, do, kwargs, DTYPES[dt])
    theirs = _sdpa_run(mx.fast.scaled_dot_product_attention, q, k, v, do, kwargs, DTYPES[dt])
    truth = _sdpa_run(mx.fast.scaled_dot_product_attention, q, k, v, do, kwargs, mx.float64)
    magnitude = max(float(np.abs(t).max()) for t in truth[1:])
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        record_drop_in(f"mlx sdpa {name}", dt, ours[i], theirs[i])
        assert_within_rule(name, ours[i], theirs[i], truth[i], dtype=dt,
                           factor=FORWARD_FACTOR if i == 0 else GRADIENT_FACTOR,
                           magnitude=None if i == 0 else magnitude)


# ---- Errors ------------------------------------------------------------------------

def test_errors_name_the_argument():
    q = mx.zeros((1, 4, 2, 8))
    with pytest.raises(TypeError, match=r"^flashattn.mlx.attention: q, k and v must share one "
                                        r"dtype; q is float32, k is float16"):
        fam.attention(q, q.astype(mx.float16), q)
    with pytest.raises(TypeError, match=r"^flashattn.mlx.attention: k must be float32, float16 or "
                                        r"bfloat16, got mlx.core.int32"):
        fam.attention(q, q.astype(mx.int32), q)
    with pytest.raises(TypeError, match=r"^flashattn.mlx.attention: v must be an mlx"):
        fam.attention(q, q, np.zeros((1, 4, 2, 8), np.float32))
    with pytest.raises(ValueError, match=r"^flashattn.mlx.attention: head size D must be in "
                                         r"1..256, got 0"):
        fam.attention(q[..., :0], q[..., :0], q[..., :0])
    with pytest.raises(ValueError, match=r"^flashattn.mlx.attention: the number of heads must be "
                                         r"at least 1"):
        fam.attention(q, q[:, :, :0], q[:, :, :0])
    with pytest.raises(ValueError, match=r"^flashattn.mlx.attention: mask must be broadcastable"):
        fam.attention(q, q, q, mask=mx.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"^flashattn.mlx.scaled_dot_product_attention: mask must "
                                         r"be 'causal', an array or None, got 'lower'"):
        fam.scaled_dot_product_attention(q, q, q, scale=1.0, mask="lower")


def test_causal_must_be_a_bool_in_every_entry_point():
    # issue 32, item 12: "False" (a str) ran causal attention before.
    q = mx.zeros((1, 4, 2, 8))
    cu = np.array([0, 4], np.int32)
    for call in (lambda: fam.attention(q, q, q, causal="False"),
                 lambda: fam.attention_varlen(q[0], q[0], q[0], cu, cu, causal="False")):
        with pytest.raises(TypeError, match=r"causal must be a bool, got str 'False'"):
            call()
