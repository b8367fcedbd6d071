"""flashattn.jax: every dtype and option against JAX's own math in float64
(forward, lse and every gradient, sinks included), under jax.jit, by
FlashAttention's rule (framework_checks.py); varlen the same; jax.vmap
gives what a loop gives; the jitted program is XLA FFI custom calls without
Python callbacks; the drop-in dot_product_attention against
jax.nn.dot_product_attention itself; errors name the argument, at trace
time (issue 32 items 12 and 13: causal="False", Hkv = 0, D = 0)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="flashattn.jax needs jax: pip install '.[jax]'")
jnp = jax.numpy

import flashattn as fa  # noqa: E402
import flashattn.jax as faj  # noqa: E402
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

DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}
OPS = Ops(einsum=jnp.einsum, where=jnp.where, exp=jnp.exp, log=jnp.log, tanh=jnp.tanh,
          maximum=jnp.maximum, repeat=lambda x, n, axis: jnp.repeat(x, n, axis=axis),
          max_last=lambda x: jnp.max(x, -1, keepdims=True),
          sum_last=lambda x: jnp.sum(x, -1, keepdims=True),
          constant=lambda a, like: jnp.asarray(a, dtype=bool if like is True else like.dtype))


def _options(options: dict, dtype) -> dict:
    return {n: (jnp.asarray(x) if x.dtype == np.bool_ else jnp.asarray(x, dtype))
            if isinstance(x, np.ndarray) else x for n, x in options.items()}


def _bhtd(x):
    return jnp.swapaxes(x, 1, 2)


def _plain(arrays, options, dtype, *, varlen=False, rounded=None):
    """o, lse and the gradients of JAX's plain math in ``dtype``, the
    gradients' delta from o rounded to ``rounded`` (framework_checks);
    jitted whole (eager JAX would compile each operation of each shape)."""
    with jax.enable_x64(dtype == jnp.float64):
        q, k, v, do = (jnp.asarray(arrays[n], dtype) for n in ("q", "k", "v", "do"))
        opts = _options(options, dtype)
        static = {n: x for n, x in opts.items() if not isinstance(x, jax.Array)}
        dynamic = {n: x for n, x in opts.items() if isinstance(x, jax.Array)}

        def run(q, k, v, do, dynamic):
            sinks = dynamic.pop("sinks", None)

            def f(q, k, v, sinks):
                if varlen:
                    return plain_varlen(OPS, jnp.concatenate, q, k, v, VARLEN_CU_Q, VARLEN_CU_K,
                                        sinks=sinks, **static, **dynamic)
                return plain_attention(OPS, q, k, v, sinks=sinks, **static, **dynamic)

            (o, lse), vjp = jax.vjp(f, q, k, v, sinks)
            c = jnp.zeros_like(lse)
            if rounded is not None:
                c = jnp.sum(do * (o - o.astype(rounded).astype(dtype)), -1)
                c = c.T if varlen else jnp.swapaxes(c, 1, 2)
            return (o, lse, *[g for g in vjp((do, c)) if g is not None])

        return [np.asarray(x, np.float64) for x in jax.jit(run)(q, k, v, do, dynamic)]


def _check(ours, arrays, options, dtype, *, varlen=False):
    truth = _plain(arrays, options, jnp.float64, varlen=varlen)
    yardstick = _plain(arrays, options, jnp.float32, varlen=varlen, rounded=DTYPES[dtype])
    magnitude = max(float(np.abs(t).max(initial=0)) for t in truth[2:5])
    assert len(ours) == len(truth)
    for i, name in enumerate(["o", "lse", "dq", "dk", "dv", "dsinks"][:len(ours)]):
        assert_within_rule(name, ours[i], yardstick[i], truth[i], dtype=dtype,
                           factor=GRADIENT_FACTOR if i >= 2 else FORWARD_FACTOR,
                           magnitude=magnitude if 2 <= i <= 4 else None,
                           out_dtype="f32" if name in ("lse", "dsinks") else None)


def _ours(attend, q, k, v, do, sinks):
    """o, lse and the gradients (q, k, v, sinks) of ``attend`` under jax.jit."""
    def loss(q, k, v, sinks):
        o, lse = attend(q, k, v, sinks)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), (o, lse)

    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    grads, (o, lse) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
    return o, lse, grads


# Every option set in bfloat16 (what training uses), and the plain and the
# everything-at-once sets in each dtype: each compile of XLA costs about a
# second on the 2-core CI machine.
MATH_CASES = ([(o, "bf16") for o in OPTION_SETS]
              + [(o, dt) for dt in ("f32", "f16") for o in ("plain", "causal-tall", "everything")])


@pytest.mark.parametrize("option_set,dt", MATH_CASES, ids=[f"{o}-{d}" for o, d in MATH_CASES])
def test_attention_matches_jax_math_under_jit(option_set, dt):
    _, arrays, options = make(option_set, dt)
    layout = "bhtd" if option_set in ("window-scale", "everything") else "bthd"
    q, k, v, do = (jnp.asarray(arrays[n], DTYPES[dt]) for n in ("q", "k", "v", "do"))
    if layout == "bhtd":
        q, k, v, do = (_bhtd(x) for x in (q, k, v, do))
    opts = _options(options, jnp.float32)
    sinks = opts.pop("sinks", None)
    o, lse, grads = _ours(lambda q, k, v, s: faj.attention(q, k, v, sinks=s, return_lse=True,
                                                           layout=layout, **opts),
                          q, k, v, do, sinks)
    assert o.dtype == DTYPES[dt] and o.shape == q.shape and lse.dtype == jnp.float32
    assert [g.dtype for g in grads[:3]] == [DTYPES[dt]] * 3
    ours = [o, lse, *grads]
    if layout == "bhtd":
        ours = [_bhtd(x) if x.ndim == 4 else x for x in ours]
    _check([np.asarray(x, np.float64) for x in ours], arrays, options, dt)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_attention_varlen_matches_jax_math_under_jit(dt):
    arrays, options = make_varlen(dt)
    q, k, v, do = (jnp.asarray(arrays[n], DTYPES[dt]) for n in ("q", "k", "v", "do"))
    opts = _options(options, jnp.float32)
    sinks = opts.pop("sinks")
    cu_q, cu_k = jnp.asarray(VARLEN_CU_Q), jnp.asarray(VARLEN_CU_K)
    o, lse, grads = _ours(lambda q, k, v, s: faj.attention_varlen(
        q, k, v, cu_q, cu_k, sinks=s, return_lse=True, **opts), q, k, v, do, sinks)
    _check([np.asarray(x, np.float64) for x in (o, lse, *grads)], arrays, options, dt,
           varlen=True)


@pytest.mark.parametrize("option_set", ["plain", "everything"])
def test_vmap_over_a_leading_axis_matches_a_loop(option_set):
    # "plain" folds the mapped axis into B; with sinks and a mask each index
    # runs as its own call. Gradients (sinks' included) under vmap too.
    _, arrays, options = make(option_set, "bf16", seed=5)
    q, k, v, do = (jnp.asarray(arrays[n], jnp.bfloat16) for n in ("q", "k", "v", "do"))
    qs, dos = jnp.stack([q, q[:, ::-1]]), jnp.stack([do, -do])
    opts = _options(options, jnp.float32)
    sinks = opts.pop("sinks", jnp.zeros(q.shape[2], jnp.float32))
    use_sinks = "sinks" in options

    def loss(q, k, v, s, do):
        o = faj.attention(q, k, v, sinks=s if use_sinks else None, **opts)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    mapped = jax.vmap(grad, in_axes=(0, None, None, None, 0))(qs, k, v, sinks, dos)
    outs = jax.vmap(lambda q: faj.attention(q, k, v, sinks=sinks if use_sinks else None,
                                            **opts))(qs)
    for i in range(2):
        np.testing.assert_array_equal(outs[i], faj.attention(qs[i], k, v, sinks=sinks if use_sinks
                                                             else None, **opts))
        for j, g in enumerate(grad(qs[i], k, v, sinks, dos[i])):
            np.testing.assert_array_equal(mapped[j][i], g)


def test_same_results_as_the_numpy_api_bit_for_bit():
    _, arrays, options = make("everything", "bf16", seed=1)
    q, k, v, do = (np.asarray(jnp.asarray(arrays[n], jnp.bfloat16)) for n in ("q", "k", "v", "do"))
    o, lse = fa.attention(q, k, v, return_lse=True, backend="cpu", **options)
    o_j, lse_j = jax.jit(lambda *a: faj.attention(*a, return_lse=True, **options))(q, k, v)
    np.testing.assert_array_equal(o_j, o)
    np.testing.assert_array_equal(lse_j, lse)
    opts = dict(options)
    sinks = opts.pop("sinks")
    grads = jax.grad(lambda q, k, v, s: jnp.sum(faj.attention(q, k, v, sinks=s, **opts)
                                                .astype(jnp.float32) * do.astype(np.float32)),
                     argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, want in zip(grads, fa.attention_backward(do, q, k, v, o, lse, backend="cpu",
                                                    **options)):
        np.testing.assert_array_equal(g, want)


def test_the_jitted_program_is_ffi_custom_calls_without_python_callbacks():
    _, arrays, options = make("everything", "f32")
    q, k, v, do = (arrays[n] for n in ("q", "k", "v", "do"))
    opts = dict(options)
    sinks = opts.pop("sinks")
    loss = lambda q, k, v, s: jnp.sum(faj.attention(q, k, v, sinks=s, **opts) * do)  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, v, sinks).as_text()
    assert "custom_call @flashattn_attention_fwd" in text
    assert "custom_call @flashattn_attention_bwd" in text
    assert "callback" not in text


# ---- The drop-in: flashattn.jax.dot_product_attention -----------------------------------

# (name, query shape (B, T, N, H), key shape (B, S, K, H), keyword arguments;
# "mask"/"bias": a bool mask or a float bias of that shape is drawn,
# "*_seq_lengths": those lengths)
DPA_CASES = [
    ("causal-gqa", (2, 17, 6, 16), (2, 17, 2, 16), dict(is_causal=True)),
    ("causal-T<S", (2, 9, 4, 16), (2, 23, 4, 16), dict(is_causal=True)),
    ("causal-T>S", (1, 23, 4, 8), (1, 9, 4, 8), dict(is_causal=True)),
    ("bias-and-mask", (2, 11, 4, 32), (2, 19, 4, 32),
     dict(bias=(2, 1, 11, 19), mask=(1, 4, 11, 19), scale=0.3)),
    ("local-window", (2, 21, 4, 16), (2, 21, 4, 16), dict(local_window_size=(3, 2))),
    ("window-causal-T<S", (1, 8, 2, 16), (1, 20, 2, 16),
     dict(local_window_size=(4, 1), is_causal=True)),
    ("seq-lengths", (3, 13, 4, 16), (3, 15, 2, 16),
     dict(query_seq_lengths=[13, 5, 0], key_value_seq_lengths=[15, 0, 7], is_causal=True)),
    ("fully-masked-rows", (2, 9, 2, 16), (2, 12, 2, 16), dict(mask=(2, 2, 9, 12), rows=True)),
    ("3d", (13, 4, 16), (13, 4, 16), dict(is_causal=True)),
]


def _dpa_inputs(case, dtype, seed=0):
    _, qs, ks, kwargs = case
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype) for s in (qs, ks, ks))
    do = jnp.asarray(rng.standard_normal(qs, dtype=np.float32), dtype)
    kwargs = dict(kwargs)
    rows = kwargs.pop("rows", False)
    if "mask" in kwargs:
        m = rng.random(kwargs["mask"]) > 0.3
        if rows:  # rows that see no key: jax gives them the mean of the values
            m[:, :, 2] = False
        kwargs["mask"] = jnp.asarray(m)
    if "bias" in kwargs:
        kwargs["bias"] = jnp.asarray(rng.standard_normal(kwargs["bias"], dtype=np.float32), dtype)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kwargs:
            kwargs[name] = jnp.asarray(kwargs[name], jnp.int32)
    return q, k, v, do, kwargs


def _dpa_run(fn, q, k, v, do, kwargs, dtype, jit=True):
    with jax.enable_x64(dtype == jnp.float64):
        q, k, v, do = (jnp.asarray(np.asarray(x, np.float32), dtype) for x in (q, k, v, do))
        kwargs = {n: jnp.asarray(np.asarray(x, np.float32), dtype) if n == "bias" else x
                  for n, x in kwargs.items()}
        arrays = {n: x for n, x in kwargs.items() if isinstance(x, jax.Array)}
        static = {n: x for n, x in kwargs.items() if n not in arrays}

        def run(q, k, v, do, arrays):
            o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **arrays, **static), q, k, v)
            return (o, *vjp(do))

        return [np.asarray(x, np.float64) for x in (jax.jit(run) if jit else run)(q, k, v, do,
                                                                                  arrays)]


# Every case in float32, the main ones in bfloat16, one in float16 (jax's own
# float16 runs eagerly, op by op: slow to compile; see below).
DPA_RUNS = ([(c, "f32") for c in DPA_CASES]
            + [(c, "bf16") for c in DPA_CASES
               if c[0] in ("causal-gqa", "bias-and-mask", "seq-lengths", "fully-masked-rows")]
            + [(DPA_CASES[3], "f16")])


@pytest.mark.parametrize("case,dt", DPA_RUNS, ids=[f"{c[0]}-{d}" for c, d in DPA_RUNS])
def test_dot_product_attention_drop_in_matches_jax(case, dt):
    q, k, v, do, kwargs = _dpa_inputs(case, DTYPES[dt])

    def theirs_fn(*a, **kw):
        return jax.nn.dot_product_attention(*a, implementation="xla", **kw)

    ours = _dpa_run(faj.dot_product_attention, q, k, v, do, kwargs, DTYPES[dt])
    # jax's float16 dot_general precision fails to lower on the CPU under jit
    # (its fallback catches the error only when run eagerly).
    theirs = _dpa_run(theirs_fn, q, k, v, do, kwargs, DTYPES[dt], jit=dt != "f16")
    truth = _dpa_run(theirs_fn, q, k, v, do, kwargs, jnp.float64)
    magnitude = max(float(np.abs(t).max()) for t in truth[1:])
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        record_drop_in(f"jax dot_product_attention {name}", dt, ours[i], theirs[i])
        assert_within_rule(name, ours[i], theirs[i], truth[i], dtype=dt,
                           factor=FORWARD_FACTOR if i == 0 else GRADIENT_FACTOR,
                           magnitude=None if i == 0 else magnitude)


def test_dot_product_attention_returns_the_residual_under_jit():
    q, k, v, do, kwargs = _dpa_inputs(DPA_CASES[0], jnp.float32)
    o, lse = jax.jit(lambda q, k, v: faj.dot_product_attention(q, k, v, return_residual=True,
                                                               **kwargs))(q, k, v)
    o_j, lse_j = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
    np.testing.assert_allclose(o, o_j, atol=2e-6)
    np.testing.assert_allclose(lse, lse_j, atol=2e-6)
    assert lse.shape == q.shape[:3]


# ---- Errors ------------------------------------------------------------------------

def test_errors_name_the_argument():
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"^flashattn.jax.attention: q, k and v must share one "
                                        r"dtype; q is float32, k is bfloat16"):
        faj.attention(q, q.astype(jnp.bfloat16), q)
    with pytest.raises(TypeError, match=r"^flashattn.jax.attention: k must be float32, float16 or "
                                        r"bfloat16, got int32"):
        faj.attention(q, q.astype(jnp.int32), q)
    with pytest.raises(ValueError, match=r"^flashattn.jax.attention: v must have 4 dimensions"):
        faj.attention(q, q, q[0])
    with pytest.raises(ValueError, match=r"^flashattn.jax.attention: the number of query heads "
                                         r"H=3 must be a multiple of the number of kv heads Hkv=2"):
        faj.attention(jnp.zeros((1, 4, 3, 8), jnp.float32), q, q)
    with pytest.raises(ValueError, match=r"^flashattn.jax.attention: window"):
        faj.attention(q, q, q, window=(1,))
    with pytest.raises(ValueError, match=r"^flashattn.jax.attention: head size D must be in "
                                         r"1..256, got 300"):
        faj.attention(*(jnp.zeros((1, 4, 2, 300), jnp.float32),) * 3)
    with pytest.raises(ValueError, match=r"^flashattn.jax.attention: sinks must be finite or "
                                         r"-inf, got nan for head 1"):
        faj.attention(q, q, q, sinks=jnp.array([0.0, jnp.nan]))


def test_hkv_0_and_d_0_are_the_numpy_apis_value_errors():
    # issue 32, item 13: both raised ZeroDivisionError before.
    q = np.zeros((1, 4, 2, 8), np.float32)
    for k, name in ((np.zeros((1, 4, 0, 8), np.float32), "heads"),
                    (np.zeros((1, 4, 2, 0), np.float32), "D")):
        qq = q if name == "heads" else q[..., :0]
        with pytest.raises(ValueError) as want:
            fa.attention(qq, k, k)
        with pytest.raises(ValueError) as got:
            jax.jit(faj.attention)(qq, k, k)
        assert str(got.value) == str(want.value).replace("attention:", "flashattn.jax.attention:",
                                                         1)


def test_causal_must_be_a_bool_in_every_entry_point():
    # issue 32, item 12: "False" (a str) ran causal attention before.
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    cu = jnp.array([0, 4], jnp.int32)
    for call in (lambda: faj.attention(q, q, q, causal="False"),
                 lambda: faj.attention_varlen(q[0], q[0], q[0], cu, cu, causal="False"),
                 lambda: faj.dot_product_attention(q, q, q, is_causal="False")):
        with pytest.raises(TypeError, match=r"(causal|is_causal) must be a bool, got str 'False'"):
            call()


def test_differentiating_a_mask_or_slopes_is_refused():
    q = jnp.ones((1, 4, 2, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"^flashattn.jax: the gradient of mask was asked for"):
        jax.grad(lambda m: jnp.sum(faj.attention(q, q, q, mask=m)))(jnp.zeros((4, 4)))
    with pytest.raises(TypeError, match=r"the gradient of alibi_slopes was asked for"):
        jax.grad(lambda a: jnp.sum(faj.attention(q, q, q, alibi_slopes=a)))(jnp.ones(2))
    mask = jnp.zeros((4, 4))  # not differentiated: taken
    jax.grad(lambda q: jnp.sum(faj.attention(q, q, q, mask=mask)))(q)


def test_bad_prefix_sums_are_caught_before_jit_and_inside_it():
    q = jnp.zeros((5, 2, 8), jnp.float32)
    bad, good = jnp.array([0, 3, 2, 5], jnp.int32), jnp.array([0, 2, 4, 5], jnp.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\] = 2 < cu_seqlens_q\[1\] = 3"):
        faj.attention_varlen(q, q, q, bad, good)
    with pytest.raises(Exception, match=r"INVALID_ARGUMENT: flashattn.jax.attention_varlen: "
                                        r"attention_varlen: cu_seqlens_q"):
        jax.block_until_ready(jax.jit(faj.attention_varlen)(q, q, q, bad, good))
