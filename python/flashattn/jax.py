"""flashattn for JAX: differentiable attention under jax.jit, jax.grad, jax.vmap.

Layouts: ``attention`` takes q (B, Tq, H, D), k and v (B, Tk, Hkv, D)
(FlashAttention's, ``layout="bthd"``, the default) or (B, H, Tq, D) with
``layout="bhtd"``; ``attention_varlen`` packed (total, H, D);
``dot_product_attention`` is a drop-in for ``jax.nn.dot_product_attention``,
with its (B, T, N, H) and semantics.

    import flashattn.jax as faj
    o = faj.attention(q, k, v, causal=True)
    o = faj.dot_product_attention(q, k, v, is_causal=True)  # as jax.nn's

float32, float16 and bfloat16, with every option of ``flashattn.attention``
(causal, window, scale, softcap, alibi_slopes, mask, sinks, return_lse).
The forward and the fused backward are XLA FFI custom calls (``jax.ffi``)
into C++ handlers of flashattn's extension (cpp/bindings/xla_handlers.cpp),
run by XLA's CPU runtime on the cpu engine: no Python and no callback in the
jitted program, and XLA's own buffers are read and written in place.
``jax.custom_vjp`` saves o and the log-sum-exp and calls the fused backward;
gradients reach q, k, v and sinks, and differentiating a mask or ALiBi
slopes is refused. The arrays must be on the CPU.
"""

from __future__ import annotations

import functools

import numpy as np

from . import _args, _core, _wrappers
from ._wrappers import require as _require

jax = _require("jax", "jax", "flashattn.jax")
jnp = jax.numpy

__all__ = ["attention", "attention_varlen", "dot_product_attention"]

_FORWARD, _BACKWARD = "flashattn_attention_fwd", "flashattn_attention_bwd"
_VARLEN_FORWARD = "flashattn_attention_varlen_fwd"
_VARLEN_BACKWARD = "flashattn_attention_varlen_bwd"


def _register() -> None:
    for name, capsule in ((_FORWARD, _core._xla_forward()), (_BACKWARD, _core._xla_backward()),
                          (_VARLEN_FORWARD, _core._xla_varlen_forward()),
                          (_VARLEN_BACKWARD, _core._xla_varlen_backward())):
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")


_register()


# ---- The compute: one function per direction ---------------------------------
# The only places that reach an engine: an XLA FFI call each (bthd layout;
# ``score`` holds the option arrays: alibi (B, H), mask (4-d), sinks (H,),
# each or None; ``static`` the Static options).

@functools.lru_cache(maxsize=None)
def _attrs(static) -> dict:
    left, right = static.window
    return dict(causal=static.causal, window_left=np.int64(left), window_right=np.int64(right),
                scale=np.float64(static.scale), softcap=np.float64(static.softcap),
                alibi=static.alibi, mask=np.int64(static.mask), sinks=static.sinks)


def _option_arrays(score: dict) -> list:
    return [score[n] for n in ("alibi", "mask", "sinks") if score[n] is not None]


def _compute_forward(q, k, v, score, static):
    if static.varlen:
        out = (jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), jnp.float32))
        return jax.ffi.ffi_call(_VARLEN_FORWARD, out, vmap_method="sequential")(
            q, k, v, *score["cu"], *_option_arrays(score), **_attrs(static))
    # broadcast_all: under vmap every operand gets the mapped axes in front;
    # the handler folds them into B (or runs once per index: sinks, masks).
    B, Tq, H, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, Tq), jnp.float32))
    return jax.ffi.ffi_call(_FORWARD, out, vmap_method="broadcast_all")(
        q, k, v, *_option_arrays(score), **_attrs(static))


def _compute_backward(do, q, k, v, o, lse, score, static):
    out = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if static.sinks:
        out.append(jax.ShapeDtypeStruct(score["sinks"].shape, jnp.float32))
    if static.varlen:
        grads = jax.ffi.ffi_call(_VARLEN_BACKWARD, tuple(out), vmap_method="sequential")(
            do, q, k, v, o, lse, *score["cu"], *_option_arrays(score), **_attrs(static))
    else:
        grads = jax.ffi.ffi_call(_BACKWARD, tuple(out), vmap_method="broadcast_all")(
            do, q, k, v, o, lse, *_option_arrays(score), **_attrs(static))
    return tuple(grads) + ((None,) if not static.sinks else ())


# ---- The differentiable function ----------------------------------------------

class _Static:
    """The options that are not arrays, hashable: one custom_vjp per set."""

    def __init__(self, causal, window, scale, softcap, alibi, mask, sinks, varlen):
        self.causal, self.window, self.scale, self.softcap = causal, window, scale, softcap
        self.alibi, self.mask, self.sinks, self.varlen = alibi, mask, sinks, varlen
        self._key = (causal, window, scale, softcap, alibi, mask, sinks, varlen)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Static) and self._key == other._key


def _is_zero(x) -> bool:
    return type(x).__name__ == "SymbolicZero"


@functools.lru_cache(maxsize=None)
def _attend(static: _Static):
    """(q, k, v, score) -> (o, lse), differentiable in q, k, v and the sinks."""

    @jax.custom_vjp
    def attend(q, k, v, score):
        return _compute_forward(q, k, v, score, static)

    def forward(q, k, v, score):
        perturbed = {n: x is not None and getattr(x, "perturbed", False) for n, x in
                     score.items()}
        for name in ("alibi", "mask"):
            if perturbed[name]:
                option = "alibi_slopes" if name == "alibi" else "mask"
                raise TypeError(f"flashattn.jax: the gradient of {option} was asked for, and "
                                f"flashattn computes none for it (only for q, k, v and sinks); "
                                f"wrap it in jax.lax.stop_gradient")
        values = [x.value for x in (q, k, v)]
        score = jax.tree_util.tree_map(lambda x: x.value, score,
                                       is_leaf=lambda x: hasattr(x, "perturbed"))
        o, lse = _compute_forward(*values, score, static)
        return (o, lse), (*values, o, lse, score)

    def backward(saved, cotangents):
        q, k, v, o, lse, score = saved
        do = cotangents[0]  # lse's cotangent is 0: lse leaves as stop_gradient(lse)
        do = jnp.zeros_like(o) if _is_zero(do) else do.astype(o.dtype)
        dq, dk, dv, dsinks = _compute_backward(do, q, k, v, o, lse, score, static)
        zeros = {n: None for n in score}
        if static.sinks:
            zeros["sinks"] = dsinks
        return dq, dk, dv, zeros

    attend.defvjp(forward, backward, symbolic_zeros=True)
    return attend


# ---- Checks --------------------------------------------------------------------

def _check_arrays(fn: str, arrays: dict, ndim: int, words: str) -> None:
    _wrappers.check_arrays(fn, arrays, ndim, words, is_array=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"),
                           kind="a JAX array", astype="jnp.float32")


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_values(fn: str, alibi_slopes, sinks) -> None:
    """The option arrays' values (finite slopes, no NaN or +inf sink), where
    they are known: outside jit and vmap."""
    if alibi_slopes is not None and _concrete(alibi_slopes):
        a = np.asarray(alibi_slopes)
        _args.alibi_slopes(fn, a, a.shape[0] if a.ndim == 2 else 1, a.shape[-1])
    if sinks is not None and _concrete(sinks):
        _args.sinks(fn, np.asarray(sinks), sinks.shape[0])


def _as_array(fn: str, name: str, x):
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{fn}: {name} must be a JAX array or None, got {type(x).__name__}")
    return jnp.asarray(x)


# ---- The FlashAttention-style entry points ---------------------------------------

def attention(q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
              alibi_slopes=None, mask=None, sinks=None, return_lse=False, layout="bthd"):
    """Exact softmax attention, fused, differentiable (the fused backward).

    Layout: q (B, Tq, H, D), k and v (B, Tk, Hkv, D) with ``layout="bthd"``
    (the default, FlashAttention's); (B, H, Tq, D) and (B, Hkv, Tk, D) with
    ``layout="bhtd"``. Returns o in q's layout and dtype, or (o, lse) with
    ``return_lse=True`` (lse (B, H, Tq) float32, under stop_gradient).

    Same contract and options as ``flashattn.attention``: float32, float16,
    bfloat16 JAX arrays on the CPU; ``alibi_slopes`` (H,) or (B, H) and
    ``sinks`` (H,) float32, ``mask`` bool or float32 broadcastable to
    (B, H, Tq, Tk). Works under ``jax.jit``, ``jax.grad`` and ``jax.vmap``;
    gradients reach q, k, v and sinks.
    """
    fn = "flashattn.jax.attention"
    _check_arrays(fn, {"q": q, "k": k, "v": v}, 4, "(B, T, heads, D) or (B, heads, T, D)")
    opts = _wrappers.options(fn, causal=causal, window=window, scale=scale, softcap=softcap,
                             return_lse=return_lse, layout=layout)
    alibi_slopes, mask, sinks = (_as_array(fn, n, x) for n, x in
                                 (("alibi_slopes", alibi_slopes), ("mask", mask),
                                  ("sinks", sinks)))
    B, Tq, H, D, Tk = _wrappers.check_shapes(fn, q.shape, k.shape, v.shape, opts)
    _wrappers.score_shapes(fn, B, H, Tq, Tk, alibi_slopes=alibi_slopes, mask=mask, sinks=sinks)
    _check_values(fn, alibi_slopes, sinks)
    if opts.layout == "bhtd":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    if alibi_slopes is not None:
        alibi_slopes = jnp.broadcast_to(alibi_slopes, (B, H))
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    mask_kind = 0 if mask is None else (1 if mask.dtype == jnp.bool_ else 2)
    static = _Static(opts.causal, opts.window, float(opts.resolved_scale(D)), opts.softcap,
                     alibi_slopes is not None, mask_kind, sinks is not None, False)
    o, lse = _attend(static)(q, k, v, dict(alibi=alibi_slopes, mask=mask, sinks=sinks))
    if opts.layout == "bhtd":
        o = jnp.swapaxes(o, 1, 2)
    return (o, jax.lax.stop_gradient(lse)) if opts.return_lse else o


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, window=(-1, -1), scale=None, softcap=0.0,
                     alibi_slopes=None, sinks=None, return_lse=False):
    """Attention over packed sequences of different lengths
    (``flash_attn_varlen_func``'s semantics), differentiable under jit and grad
    (vmap maps it one call at a time).

    Layout: q (total_q, H, D), k and v (total_k, Hkv, D); ``cu_seqlens_q``
    and ``cu_seqlens_k`` (batch + 1,) int32 (or int64 that fits) prefix sums,
    checked here when known (outside jit) and by the handler where it runs.
    Returns o (total_q, H, D), or (o, lse) with lse (H, total_q) float32.
    The options are ``attention``'s (no mask); alibi_slopes (H,) or (batch, H).
    """
    fn = "flashattn.jax.attention_varlen"
    _check_arrays(fn, {"q": q, "k": k, "v": v}, 3, "(total, heads, D)")
    opts = _wrappers.options(fn, causal=causal, window=window, scale=scale, softcap=softcap,
                             return_lse=return_lse)
    _wrappers.check_varlen_shapes(fn, q.shape, k.shape, v.shape, opts)
    cu = [_as_array(fn, n, x) for n, x in (("cu_seqlens_q", cu_seqlens_q),
                                           ("cu_seqlens_k", cu_seqlens_k))]
    for name, x in zip(("cu_seqlens_q", "cu_seqlens_k"), cu):
        if x is None or x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{fn}: {name} must be a 1-d int32 array, got "
                            f"{getattr(x, 'dtype', None)} of shape {getattr(x, 'shape', None)}")
    if all(_concrete(x) for x in cu):
        _args.varlen_sequences(fn, np.broadcast_to(np.empty((), bool), q.shape),
                               np.broadcast_to(np.empty((), bool), k.shape), np.asarray(cu[0]),
                               np.asarray(cu[1]), max_seqlen_q, max_seqlen_k)
    cu = [x.astype(jnp.int32) for x in cu]
    batch, H, D = cu[0].shape[0] - 1, q.shape[1], q.shape[2]
    alibi_slopes, sinks = (_as_array(fn, n, x) for n, x in (("alibi_slopes", alibi_slopes),
                                                           ("sinks", sinks)))
    _wrappers.score_shapes(fn, batch, H, 1, 1, alibi_slopes=alibi_slopes, sinks=sinks)
    _check_values(fn, alibi_slopes, sinks)
    if alibi_slopes is not None:
        alibi_slopes = jnp.broadcast_to(alibi_slopes, (batch, H))
    static = _Static(opts.causal, opts.window, float(opts.resolved_scale(D)), opts.softcap,
                     alibi_slopes is not None, 0, sinks is not None, True)
    o, lse = _attend(static)(q, k, v, dict(alibi=alibi_slopes, mask=None, sinks=sinks,
                                           cu=tuple(jax.lax.stop_gradient(x) for x in cu)))
    return (o, jax.lax.stop_gradient(lse)) if opts.return_lse else o


# ---- The drop-in for jax.nn.dot_product_attention ----------------------------------

def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False):
    """``jax.nn.dot_product_attention`` computed by flashattn.

    JAX's layout and semantics: query (B, T, N, H) or (T, N, H), key and
    value (B, S, K, H) with N a multiple of K; ``bias`` added to the scaled
    logits and ``mask`` (bool, True takes part) 4-d, broadcastable to
    (B, N, T, S); ``is_causal`` and ``local_window_size`` aligned top-left
    (query i sees keys i - left <= j <= i + right); ``query_seq_lengths``
    and ``key_value_seq_lengths`` (B,) int32 pad the ends. A row that sees no
    key gets the mean of all S values, as jax's "xla" implementation gives,
    and padded query rows give 0. ``return_residual`` also returns the
    log-sum-exp (B, T, N) (-inf for a row that sees no key).
    ``implementation`` is accepted and ignored: flashattn computes. A bias
    is used as float32; bias and mask with the same shape are combined into
    one float mask (an array of their broadcast shape).
    """
    fn = "flashattn.jax.dot_product_attention"
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    three_d = query.ndim == 3
    if three_d:
        query, key, value = (x[None] for x in (query, key, value))
    if bias is not None:
        bias = jnp.asarray(bias).astype(jnp.float32)
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"{fn}: mask must be bool (True: takes part; an additive mask "
                             f"goes to bias), got {mask.dtype}")
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    B, T, N, Hd = query.shape
    S, K = key.shape[1], key.shape[2]
    if key.shape != value.shape or key.shape[0] != B or key.shape[3] != Hd:
        raise ValueError(f"{fn}: key and value must be (B, S, K, H) = (B, S, K, {Hd}) with query's "
                         f"B = {B}, got {key.shape} and {value.shape}")
    if K == 0 or N % K:
        raise ValueError(f"{fn}: the number of query heads must be a multiple of key/value "
                         f"heads, but got {N} vs {K}")
    is_causal = _args.flag(fn, "is_causal", is_causal)
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    left, right = (None, None) if local_window_size is None else local_window_size
    if is_causal:
        right = 0 if right is None else min(right, 0)
    band = _wrappers.top_left_band(T, S, left, right)
    keys, window = (S, (-1, -1)) if band is None else band
    if band is None:  # not a window of flashattn's: the band as a mask
        i, j = np.arange(T)[:, None], np.arange(S)[None, :]
        inside = (j >= i - (left if left is not None else S)) & (j <= i + (right if right
                                                                            is not None else S))
        mask = jnp.asarray(inside)[None, None] if mask is None else mask & inside
    if key_value_seq_lengths is not None:
        kv = jnp.arange(S)[None, :] < jnp.asarray(key_value_seq_lengths)[:, None]
        kv = kv[:, None, None, :]
        mask = kv if mask is None else mask & kv
    k, v = key[:, :keys], value[:, :keys]
    if mask is not None:
        mask = mask[..., :keys] if mask.shape[-1] == S else mask
    if bias is not None:
        bias = bias[..., :keys] if bias.shape[-1] == S else bias
        mask = bias if mask is None else jnp.where(mask, bias, -jnp.inf)
    o, lse = attention(query, k, v, window=window, scale=scale, mask=mask, return_lse=True)
    # A row that sees no key: jax's finite fill gives every key the same logit.
    mean_v = jnp.repeat(jnp.mean(value.astype(jnp.float32), axis=1), N // K, axis=1)
    unseen = jnp.isneginf(jnp.swapaxes(lse, 1, 2))[..., None]  # (B, T, N, 1)
    o = jnp.where(unseen, mean_v[:, None].astype(o.dtype), o)
    if query_seq_lengths is not None:
        rows = jnp.arange(T)[None, :] < jnp.asarray(query_seq_lengths)[:, None]
        o = o * rows[:, :, None, None].astype(o.dtype)
    lse = jnp.swapaxes(lse, 1, 2).astype(key.dtype)
    if three_d:
        o, lse = o[0], lse[0]
    return (o, jax.lax.stop_gradient(lse)) if return_residual else o
