"""The oracle: the attention contract in plain NumPy, written to be read.

Computes in float64 by default and materialises the full (Tq, Tk) score
matrix, so it is simple and exact, and its memory is O(T²): use it on small
inputs. ``dtype=np.float32`` gives the plain unfused float32 implementation
that the tests measure the engines' error against.
"""

from __future__ import annotations

import numpy as np

from . import _main_interpreter  # first: refuses a subinterpreter before _core loads
from . import _args, _core

__all__ = ["visible_keys", "attention", "attention_backward"]


def visible_keys(Tq: int, Tk: int, *, causal=False, window=(-1, -1)) -> np.ndarray:
    """Boolean (Tq, Tk): may query row i see key j?

    Query i sits at key position p = i + Tk - Tq (bottom-right alignment) and
    sees keys p - left <= j <= p + right, -1 meaning unbounded; causal caps
    right at 0.
    """
    left, right = _args.window("visible_keys", window)
    left, right = min(left, Tk), min(right, Tq)  # past every key is unbounded
    if causal:
        right = 0
    p = np.arange(Tq)[:, None] + (Tk - Tq)
    j = np.arange(Tk)[None, :]
    mask = np.ones((Tq, Tk), dtype=bool)
    if left >= 0:
        mask &= j >= p - left
    if right >= 0:
        mask &= j <= p + right
    return mask


def _arguments(fn, arrays, names, causal, window, scale, dtype):
    """The arrays in ``dtype``, and the options checked as the engines check
    them (same errors, same messages): returns (arrays, causal, window, scale)."""
    arrays = [np.asarray(_args.array(fn, name, x), dtype=dtype) for name, x in zip(names, arrays)]
    causal, window = _args.flag(fn, "causal", causal), _args.window(fn, window)
    q, k, v = arrays[names.index("q")], arrays[names.index("k")], arrays[names.index("v")]
    _core.check_call(fn, q.shape, k.shape, v.shape, causal, *window, _args.scale(fn, scale))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    return arrays, causal, window, dtype(scale)


def _probabilities(q, k, causal, window, scale):
    """P (B, H, Tq, Tk) and lse (B, H, Tq), kv heads repeated for GQA."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    k = np.repeat(k, H // Hkv, axis=2)  # query head h reads kv head h // (H // Hkv)
    s = np.einsum("bqhd,bkhd->bhqk", q * scale, k)  # scale first, as the engines do
    mask = visible_keys(Tq, Tk, causal=causal, window=window)
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if Tk else np.full((B, H, Tq, 1), -np.inf, s.dtype)
    m_safe = np.where(np.isneginf(m), 0, m)  # a row that sees no key has m = -inf
    e = np.where(mask, np.exp(s - m_safe), 0)
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, e / l, 0)
        lse = np.where(l > 0, m_safe + np.log(l), -np.inf)[..., 0]
    return p, lse


def attention(q, k, v, *, causal=False, window=(-1, -1), scale=None, return_lse=False,
              dtype=np.float64):
    """Same contract as flashattn.attention; computed in ``dtype``.

    Returns o (B, Tq, H, D) or (o, lse) with lse (B, H, Tq), in ``dtype``.
    """
    (q, k, v), causal, window, scale = _arguments("attention", (q, k, v), ("q", "k", "v"),
                                                   causal, window, scale, dtype)
    return_lse = _args.flag("attention", "return_lse", return_lse)
    p, lse = _probabilities(q, k, causal, window, scale)
    v = np.repeat(v, q.shape[2] // v.shape[2], axis=2)
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    return (o, lse) if return_lse else o


def attention_backward(do, q, k, v, o=None, lse=None, *, causal=False, window=(-1, -1),
                       scale=None, dtype=np.float64):
    """Same contract as flashattn.attention_backward; computed in ``dtype``.

    P is recomputed from q and k in ``dtype`` (the oracle trusts nothing it is
    handed); ``o`` and ``lse`` are accepted so that calls read the same as
    with the engines, and are not used. Returns dq, dk, dv.
    """
    (do, q, k, v), causal, window, scale = _arguments(
        "attention_backward", (do, q, k, v), ("do", "q", "k", "v"), causal, window, scale, dtype)
    if do.shape != q.shape:
        raise ValueError(f"attention_backward: do must have the shape of q {q.shape}, "
                         f"got {do.shape}")
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    p, _ = _probabilities(q, k, causal, window, scale)
    k_rep = np.repeat(k, group, axis=2)
    v_rep = np.repeat(v, group, axis=2)

    dv_rep = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, v_rep)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))  # softmax backward
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k_rep) * scale
    dk_rep = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale

    # Query heads that share a kv head add their gradients into it.
    dk = dk_rep.reshape(B, Tk, Hkv, group, D).sum(axis=3)
    dv = dv_rep.reshape(B, Tk, Hkv, group, D).sum(axis=3)
    return dq, dk, dv
