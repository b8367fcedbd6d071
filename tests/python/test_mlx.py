"""flashattn.mlx: the output and the gradients (mx.grad through the
custom_function's vjp, the fused backward) match MLX's own
scaled_dot_product_attention by FlashAttention's rule; errors name the
argument."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="flashattn.mlx needs mlx: pip install '.[mlx]'")

import flashattn as fa  # noqa: E402
import flashattn.mlx as fam  # noqa: E402
from framework_checks import (  # noqa: E402
    FORWARD_FACTOR,
    GRADIENT_FACTOR,
    assert_as_close_as,
    inputs,
    reference,
)

CASES = [  # (B, T, H, Hkv, D, causal), Tq == Tk
    (2, 37, 4, 4, 16, False),
    (2, 64, 4, 2, 32, True),
    (1, 113, 6, 1, 59, True),
]


def _mlx_sdpa(causal):
    def attend(q, k, v):  # MLX's layout is (B, H, T, D)
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / np.sqrt(q.shape[-1]),
                                                 mask="causal" if causal else None)
        return o.transpose(0, 2, 1, 3)
    return attend


@pytest.mark.parametrize("case", CASES, ids=str)
def test_output_and_gradients_match_mlx_attention(case):
    B, T, H, Hkv, D, causal = case
    q, k, v, do = inputs(B, T, T, H, Hkv, D)
    Q, K, V, DO = (mx.array(x) for x in (q, k, v, do))

    def ours(q, k, v):
        return fam.attention(q, k, v, causal=causal)

    theirs = _mlx_sdpa(causal)
    results = {}
    for name, attend in (("ours", ours), ("theirs", theirs)):
        o = attend(Q, K, V)
        grads = mx.grad(lambda q, k, v: (attend(q, k, v) * DO).sum(), argnums=(0, 1, 2))(Q, K, V)
        results[name] = [np.array(x) for x in (o, *grads)]

    o64, grads64 = reference(q, k, v, do, causal=causal)
    for i, (name, want) in enumerate(zip(("o", "dq", "dk", "dv"), (o64, *grads64))):
        factor = FORWARD_FACTOR if name == "o" else GRADIENT_FACTOR
        assert results["ours"][i].shape == want.shape
        assert_as_close_as(name, results["ours"][i], results["theirs"][i], want, factor=factor)


def test_window_and_cross_attention_match_the_numpy_api_bit_for_bit():
    q, k, v, do = inputs(2, 29, 41, 4, 2, 16)
    opts = dict(causal=True, window=(5, 0))
    Q, K, V, DO = (mx.array(x) for x in (q, k, v, do))
    o = fam.attention(Q, K, V, backend="cpu", **opts)
    grads = mx.grad(lambda q, k, v: (fam.attention(q, k, v, backend="cpu", **opts) * DO).sum(),
                    argnums=(0, 1, 2))(Q, K, V)
    o_np, lse = fa.attention(q, k, v, return_lse=True, backend="cpu", **opts)
    np.testing.assert_array_equal(np.array(o), o_np)
    for g, want in zip(grads, fa.attention_backward(do, q, k, v, o_np, lse, backend="cpu",
                                                    **opts)):
        np.testing.assert_array_equal(np.array(g), want)


def test_errors_name_the_argument():
    q = mx.zeros((1, 4, 2, 8))
    with pytest.raises(TypeError, match=r"^flashattn.mlx.attention: k must be float32"):
        fam.attention(q, q.astype(mx.float16), q)
    with pytest.raises(TypeError, match=r"^flashattn.mlx.attention: v must be an mlx"):
        fam.attention(q, q, np.zeros((1, 4, 2, 8), np.float32))
