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

__all__ = ["visible_keys", "attention", "attention_backward", "attention_varlen",
           "attention_varlen_backward"]


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


def _arguments(fn, arrays, names, opts, dtype):
    """The arrays in ``dtype``, and the options checked as the engines check
    them (same errors, same messages): returns (arrays, options) with the
    options a dict of causal, window, scale, softcap, alibi (B, H), mask
    (a (B, H, Tq, Tk) view) and sinks (H,), the arrays among them in ``dtype``
    (a bool mask stays bool)."""
    arrays = [np.asarray(_args.array(fn, name, x), dtype=dtype) for name, x in zip(names, arrays)]
    causal, window = _args.flag(fn, "causal", opts["causal"]), _args.window(fn, opts["window"])
    q, k, v = arrays[names.index("q")], arrays[names.index("k")], arrays[names.index("v")]
    _core.check_call(fn, q.shape, k.shape, v.shape, causal, *window, _args.scale(fn, opts["scale"]))
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    scale = opts["scale"]
    scale = 1 / np.sqrt(D) if scale is None else scale
    floats = _args.REFERENCE_FLOATS
    alibi = _args.alibi_slopes(fn, opts["alibi_slopes"], B, H, floats)
    mask = _args.mask(fn, opts["mask"], B, H, Tq, Tk, floats)
    sinks = _args.sinks(fn, opts["sinks"], H, floats)
    return arrays, dict(
        causal=causal, window=window, scale=dtype(scale),
        softcap=dtype(_args.softcap(fn, opts["softcap"])),
        alibi=None if alibi is None else alibi.astype(dtype),
        mask=None if mask is None else (mask if mask.dtype == bool else mask.astype(dtype)),
        sinks=None if sinks is None else sinks.astype(dtype))


def _scores(q, k, o):
    """The logits s (B, H, Tq, Tk), -inf where a key is hidden, and the
    derivative of s with respect to scale * q.k (the softcap's; else 1).

    The options apply in the contract's order: softcap, then ALiBi, then the
    mask; then the causal/window band hides keys."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    k = np.repeat(k, H // Hkv, axis=2)  # query head h reads kv head h // (H // Hkv)
    s = np.einsum("bqhd,bkhd->bhqk", q * o["scale"], k)  # scale first, as the engines do
    ds_dscore = np.ones_like(s)
    if o["softcap"] > 0:
        t = np.tanh(s / o["softcap"])
        s = o["softcap"] * t
        ds_dscore = 1 - t * t
    if o["alibi"] is not None:
        distance = np.abs(np.arange(Tq)[:, None] + (Tk - Tq) - np.arange(Tk)[None, :])
        s = s - o["alibi"][:, :, None, None] * distance.astype(s.dtype)
    visible = visible_keys(Tq, Tk, causal=o["causal"], window=o["window"])
    if o["mask"] is not None and o["mask"].dtype == bool:
        visible = visible & o["mask"]
    elif o["mask"] is not None:
        s = s + o["mask"]  # a float mask of -inf hides its key
    return np.where(visible, s, -np.inf), ds_dscore


def _probabilities(s, sinks):
    """P (B, H, Tq, Tk), the sink's probability (B, H, Tq) and lse (B, H, Tq)
    from the logits s. A sink is one more logit per head, with a zero value
    vector: it is in the denominator (and lse), never in the output."""
    B, H, Tq, _ = s.shape
    sink = np.full((1, H, 1, 1), -np.inf, s.dtype) if sinks is None else sinks[None, :, None, None]
    m = np.maximum(s.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    # A row that sees no key (nor sink) has m = -inf: o = 0, lse = -inf. A
    # NaN or +inf score makes m NaN or +inf and, by IEEE arithmetic (inf -
    # inf is NaN), l NaN: that row's p and lse are NaN, as the README says
    # and the engines do (not the "sees no key" row).
    none = np.isneginf(m)
    m_safe = np.where(none, 0, m)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.exp(s - m_safe)  # exp(-inf) = 0 for hidden keys
        e_sink = np.exp(sink - m_safe)
        l = e.sum(axis=-1, keepdims=True) + e_sink
        p = np.where(none, 0, e / l)
        p_sink = np.where(none, 0, e_sink / l)[..., 0]
        lse = np.where(none, -np.inf, m_safe + np.log(l))[..., 0]
    return p, p_sink, lse


def attention(q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
              alibi_slopes=None, mask=None, sinks=None, return_lse=False, dtype=np.float64):
    """Same contract as flashattn.attention; computed in ``dtype``.

    Returns o (B, Tq, H, D) or (o, lse) with lse (B, H, Tq), in ``dtype``.
    """
    opts = dict(causal=causal, window=window, scale=scale, softcap=softcap,
                alibi_slopes=alibi_slopes, mask=mask, sinks=sinks)
    (q, k, v), o = _arguments("attention", (q, k, v), ("q", "k", "v"), opts, dtype)
    return_lse = _args.flag("attention", "return_lse", return_lse)
    s, _ = _scores(q, k, o)
    p, _, lse = _probabilities(s, o["sinks"])
    v = np.repeat(v, q.shape[2] // v.shape[2], axis=2)
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    return (out, lse) if return_lse else out


def attention_backward(do, q, k, v, o=None, lse=None, *, causal=False, window=(-1, -1),
                       scale=None, softcap=0.0, alibi_slopes=None, mask=None, sinks=None,
                       dtype=np.float64, delta_from_o=False):
    """Same contract as flashattn.attention_backward; computed in ``dtype``.

    P is recomputed from q and k in ``dtype`` (the oracle trusts nothing it is
    handed); ``o`` and ``lse`` are accepted so that calls read the same as
    with the engines, and are not used, except that ``delta_from_o=True``
    takes the softmax backward's delta = rowsum(do * o) from the ``o`` handed
    in, as FlashAttention's backward (and every engine's) does: the plain
    implementation of the same inputs, which the tests measure the engines
    against when o is float16 or bfloat16 and so not exact. Returns dq, dk,
    dv, and dsinks (H,) when ``sinks`` is given.
    """
    opts = dict(causal=causal, window=window, scale=scale, softcap=softcap,
                alibi_slopes=alibi_slopes, mask=mask, sinks=sinks)
    (do, q, k, v), opt = _arguments("attention_backward", (do, q, k, v), ("do", "q", "k", "v"),
                                    opts, dtype)
    if do.shape != q.shape:
        raise ValueError(f"attention_backward: do must have the shape of q {q.shape}, "
                         f"got {do.shape}")
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    s, ds_dscore = _scores(q, k, opt)
    p, p_sink, _ = _probabilities(s, opt["sinks"])
    k_rep = np.repeat(k, group, axis=2)
    v_rep = np.repeat(v, group, axis=2)

    dv_rep = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, v_rep)
    # Softmax backward; the sink's dp is 0 (its value vector is zero), so
    # delta = sum_j p dp = do . o, sink or not.
    if delta_from_o:
        if o is None or np.shape(o) != q.shape:
            raise ValueError(f"attention_backward: delta_from_o needs o of q's shape {q.shape}")
        o = np.asarray(_args.array("attention_backward", "o", o), dtype=dtype)
        delta = np.einsum("bqhd,bqhd->bhq", do, o)[..., None]
    else:
        delta = (dp * p).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta) * ds_dscore  # through the softcap's tanh to scale * q.k
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k_rep) * opt["scale"]
    dk_rep = np.einsum("bhqk,bqhd->bkhd", ds, q) * opt["scale"]

    # Query heads that share a kv head add their gradients into it.
    dk = dk_rep.reshape(B, Tk, Hkv, group, D).sum(axis=3)
    dv = dv_rep.reshape(B, Tk, Hkv, group, D).sum(axis=3)
    if opt["sinks"] is None:
        return dq, dk, dv
    # d lse / d sink = p_sink, and o does not depend on the sink but through
    # the shared denominator: d L / d sink = -sum over rows of p_sink * delta.
    dsinks = -(p_sink * delta[..., 0]).sum(axis=(0, 2))
    return dq, dk, dv, dsinks


def _sequences(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The checked prefix sums, and the (rows of q, rows of k) of each sequence."""
    cu_q, cu_k = _args.varlen_sequences(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k)
    return [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]))
            for b in range(cu_q.shape[0] - 1)]


def _sequence_options(opts, alibi_slopes, b):
    """The options of sequence b: its row of (batch, H) slopes, if so given."""
    slopes = alibi_slopes
    if slopes is not None and np.ndim(slopes) == 2:
        slopes = slopes[b]
    return dict(opts, alibi_slopes=slopes)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, window=(-1, -1), scale=None, softcap=0.0,
                     alibi_slopes=None, sinks=None, return_lse=False, dtype=np.float64):
    """Same contract as flashattn.attention_varlen; computed in ``dtype``, one
    sequence at a time: q (total_q, H, D), k, v (total_k, Hkv, D); returns o
    (total_q, H, D) or (o, lse) with lse (H, total_q)."""
    fn = "attention_varlen"
    seqs = _sequences(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return_lse = _args.flag(fn, "return_lse", return_lse)
    H = q.shape[1]
    o = np.zeros((q.shape[0], H, q.shape[2]), dtype)
    lse = np.full((H, q.shape[0]), -np.inf, dtype)
    opts = dict(causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks)
    for b, (rq, rk) in enumerate(seqs):
        o_b, lse_b = attention(q[None, rq], k[None, rk], v[None, rk], return_lse=True,
                               dtype=dtype, **_sequence_options(opts, alibi_slopes, b))
        o[rq], lse[:, rq] = o_b[0], lse_b[0]
    return (o, lse) if return_lse else o


def attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, causal=False,
                              window=(-1, -1), scale=None, softcap=0.0, alibi_slopes=None,
                              sinks=None, dtype=np.float64):
    """Same contract as flashattn.attention_varlen_backward; computed in
    ``dtype``. Returns dq, dk, dv (and dsinks (H,) with ``sinks``)."""
    fn = "attention_varlen_backward"
    seqs = _sequences(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    grads = [np.zeros(np.shape(x), dtype) for x in (q, k, v)]
    dsinks = None if sinks is None else np.zeros(np.shape(sinks), dtype)
    opts = dict(causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks)
    for b, (rq, rk) in enumerate(seqs):
        g = attention_backward(do[None, rq], q[None, rq], k[None, rk], v[None, rk], dtype=dtype,
                               **_sequence_options(opts, alibi_slopes, b))
        for grad, part, rows in zip(grads, g, (rq, rk, rk)):
            grad[rows] = part[0]
        if dsinks is not None:
            dsinks += g[3]
    return (*grads, dsinks) if sinks is not None else tuple(grads)
