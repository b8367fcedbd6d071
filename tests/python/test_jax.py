"""flashattn.jax: under jax.jit, jax.grad and jax.vmap the output and the
gradients match JAX's own dot_product_attention by FlashAttention's rule;
the jitted program is one XLA FFI custom call per direction (no Python
callback in it); errors name the argument."""

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
    assert_as_close_as,
    inputs,
    reference,
)

# (B, T, H, Hkv, D, causal); Tq == Tk, the case JAX's causal mask covers.
CASES = [
    (2, 37, 4, 4, 16, False),
    (2, 64, 4, 2, 32, True),
    (1, 113, 6, 1, 59, True),
]


def _loss(attend, do):
    return lambda q, k, v: jnp.sum(attend(q, k, v) * do)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_jit_and_grad_match_jax_attention(case):
    B, T, H, Hkv, D, causal = case
    q, k, v, do = inputs(B, T, T, H, Hkv, D)

    def ours(q, k, v):
        return faj.attention(q, k, v, causal=causal)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    o = jax.jit(ours)(q, k, v)
    o_jax = jax.jit(theirs)(q, k, v)
    grads = jax.jit(jax.grad(_loss(ours, do), argnums=(0, 1, 2)))(q, k, v)
    grads_jax = jax.jit(jax.grad(_loss(theirs, do), argnums=(0, 1, 2)))(q, k, v)

    o64, grads64 = reference(q, k, v, do, causal=causal)
    assert o.shape == q.shape and o.dtype == jnp.float32
    assert_as_close_as("o", o, o_jax, o64, factor=FORWARD_FACTOR)
    for name, g, g_jax, g64 in zip(("dq", "dk", "dv"), grads, grads_jax, grads64):
        assert g.shape == g64.shape
        assert_as_close_as(name, g, g_jax, g64, factor=GRADIENT_FACTOR)


def test_window_scale_and_cross_attention_match_the_reference():
    q, k, v, do = inputs(2, 29, 41, 4, 2, 16)
    opts = dict(causal=True, window=(5, 0), scale=0.2)
    o = faj.attention(q, k, v, **opts)
    grads = jax.grad(_loss(lambda q, k, v: faj.attention(q, k, v, **opts), do),
                     argnums=(0, 1, 2))(q, k, v)
    o64 = fa.reference.attention(q, k, v, **opts)
    grads64 = fa.reference.attention_backward(do, q, k, v, **opts)
    np.testing.assert_allclose(o, o64, atol=1e-5)
    for g, g64 in zip(grads, grads64):
        np.testing.assert_allclose(g, g64, atol=1e-4)


def test_same_results_as_the_numpy_api_bit_for_bit():
    q, k, v, do = inputs(1, 50, 50, 4, 2, 32)
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    np.testing.assert_array_equal(jax.jit(lambda *a: faj.attention(*a, causal=True))(q, k, v), o)
    grads = jax.grad(_loss(lambda *a: faj.attention(*a, causal=True), do),
                     argnums=(0, 1, 2))(q, k, v)
    for g, want in zip(grads, fa.attention_backward(do, q, k, v, o, lse, causal=True,
                                                    backend="cpu")):
        np.testing.assert_array_equal(g, want)


def test_vmap_over_a_leading_axis_matches_a_loop():
    q, k, v, do = inputs(6, 21, 21, 4, 2, 8)
    qs, ks, vs, dos = (x.reshape(2, 3, *x.shape[1:]) for x in (q, k, v, do))

    def attend(q, k, v):
        return faj.attention(q, k, v, causal=True)

    o = jax.vmap(attend)(qs, ks, vs)
    grads = jax.vmap(jax.grad(lambda q, k, v, do: jnp.sum(attend(q, k, v) * do),
                              argnums=(0, 1, 2)))(qs, ks, vs, dos)
    for i in range(2):
        np.testing.assert_array_equal(o[i], attend(qs[i], ks[i], vs[i]))
    loop = [jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * dos[i]), argnums=(0, 1, 2))(
        qs[i], ks[i], vs[i]) for i in range(2)]
    for j in range(3):
        np.testing.assert_array_equal(grads[j], np.stack([loop[i][j] for i in range(2)]))
    # k and v shared across the mapped axis: broadcast to the batch of q.
    o_shared = jax.vmap(lambda q: attend(q, ks[0], vs[0]))(qs)
    np.testing.assert_array_equal(o_shared[1], attend(qs[1], ks[0], vs[0]))


def test_the_jitted_program_is_ffi_custom_calls_without_python_callbacks():
    q, k, v, do = inputs(1, 8, 8, 2, 2, 8)
    text = jax.jit(jax.grad(_loss(faj.attention, do), argnums=(0, 1, 2))).lower(
        q, k, v).as_text()
    assert "custom_call @flashattn_attention_fwd" in text
    assert "custom_call @flashattn_attention_bwd" in text
    assert "callback" not in text


def test_errors_name_the_argument():
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"^flashattn.jax.attention: k must be float32"):
        faj.attention(q, q.astype(jnp.bfloat16), q)
    with pytest.raises(ValueError, match=r"^flashattn.jax.attention: v must have 4 dimensions"):
        faj.attention(q, q, q[0])
    with pytest.raises(ValueError, match=r"^flashattn.jax.attention: q .* multiple"):
        faj.attention(jnp.zeros((1, 4, 3, 8), jnp.float32), q, q)
    with pytest.raises(ValueError, match=r"^flashattn.jax.attention: window"):
        faj.attention(q, q, q, window=(1,))


def test_the_cores_shape_errors_reach_the_caller_from_the_jitted_call():
    q = jnp.zeros((1, 4, 2, 300), jnp.float32)
    with pytest.raises(RuntimeError, match=r"INVALID_ARGUMENT: flashattn.jax: attention: head "
                                           r"size D must be in 1..256, got 300"):
        jax.block_until_ready(faj.attention(q, q, q))
