"""flashattn for MLX: differentiable attention with the fused backward.

Layouts: ``attention`` takes q (B, Tq, H, D), k and v (B, Tk, Hkv, D)
(FlashAttention's, ``layout="bthd"``, the default) or MLX's (B, H, Tq, D)
with ``layout="bhtd"``; ``attention_varlen`` packed (total, H, D);
``scaled_dot_product_attention`` is a drop-in for
``mx.fast.scaled_dot_product_attention``, with MLX's (B, N, T, D) and
semantics.

    import flashattn.mlx as fam
    o = fam.attention(q, k, v, causal=True)
    o = fam.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal")

float32, float16 and bfloat16, with every option of ``flashattn.attention``
(causal, window, scale, softcap, alibi_slopes, mask, sinks, return_lse).
Each call is an ``mx.custom_function`` whose forward returns o and the
log-sum-exp and whose vjp runs the fused backward for q, k, v and sinks, so
``mx.grad`` and ``mx.value_and_grad`` work through it. MLX does not tell a
vjp which inputs are differentiated, so the gradients of an additive mask
and of ALiBi slopes are given too, by MLX's own unfused math (O(Tq·Tk)
memory), built lazily: computed only when asked for. The metal engine
computes on a Mac (the default there), the cpu engine elsewhere;
``backend=`` picks one.

On a Mac whose MLX computes on the GPU (the default there), both run in
MLX's own stream (``backend=None``; flashattn._instream, docs/metal.md): the
kernels of the metal engine, compiled by ``mx.fast.metal_kernel`` from the
shipped shaders, dispatched lazily on MLX's arrays, outputs allocated by
MLX; nothing is copied to the host and nothing waits. That path works
under ``mx.compile`` too.

Elsewhere, or with ``backend=`` naming an engine, the host-copy path:

- inputs are read in place: an MLX array in host or unified memory is
  viewed by NumPy through DLPack or the buffer protocol (bfloat16 as its
  uint16 bits), evaluating it first, as any read does. On a Mac the metal
  engine then copies each input that is not one of its pool buffers once
  into one (docs/metal.md), O(B·T·H·D);
- outputs are copied once each into new MLX arrays: ``mx.array`` cannot
  wrap memory it did not allocate.

Nothing of size T² is made (but for the mask and slope gradients above).
The host-copy path reads arrays on the CPU, so it cannot run inside
``mx.compile``: it raises a RuntimeError saying so. Varlen calls always
take the host-copy path.
"""

from __future__ import annotations

import numpy as np

from . import _api, _args, _wrappers, reference
from ._wrappers import require as _require

mx = _require("mlx.core", "mlx", "flashattn.mlx")

from ._instream import mlx_stream as _instream  # noqa: E402  (imports mlx)

__all__ = ["attention", "attention_varlen", "scaled_dot_product_attention"]


# ---- Between MLX arrays and the NumPy API ----------------------------------------

def _numpy(x):
    """An option array (float32 or bool) as NumPy views it, or None."""
    return None if x is None else np.asarray(x)


def _mlx(a: np.ndarray):
    """A NumPy result as a new MLX array (one copy: MLX cannot wrap it)."""
    if a.dtype.name == "bfloat16":  # ml_dtypes': MLX reads its bits
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    return mx.array(a)


# ---- The compute: one function per direction ---------------------------------------
# The only places that reach an engine (bthd layout): in MLX's stream on a
# Mac with MLX's GPU (flashattn._instream), else the host-copy path.

def _stream_host(static, cu):
    """The in-stream host for this call (no engine named, not varlen), or None."""
    return _instream.host() if static.backend is None and cu is None else None


def _host_copy(fn, compute):
    """compute() on the host-copy path; inside mx.compile, where MLX will not
    hand arrays to the CPU, a RuntimeError that says why."""
    try:
        return compute()
    except RuntimeError as e:
        if "function transformations" not in str(e):
            raise
        raise RuntimeError(
            f"{fn}: cannot run inside mx.compile (or mx.vmap) on the host-copy path, "
            "which reads the arrays on the CPU; flashattn runs in MLX's stream, and so under "
            "mx.compile, only on a Mac with MLX's GPU and backend=None (here: call it outside "
            "the compiled function)") from e


def _compute_forward(q, k, v, static, alibi, mask, sinks, cu=None):
    host = _stream_host(static, cu)
    if host is not None:
        return _instream.forward(host, q, k, v, causal=static.causal, window=static.window,
                                 scale=static.scale, softcap=static.softcap,
                                 alibi_slopes=alibi, mask=mask, sinks=sinks)
    return _host_copy(static.fn, lambda: _host_forward(q, k, v, static, alibi, mask, sinks, cu))


def _compute_backward(do, q, k, v, o, lse, static, alibi, mask, sinks, cu=None):
    host = _stream_host(static, cu)
    if host is not None:
        return _instream.backward(host, do, q, k, v, o, lse, causal=static.causal,
                                  window=static.window, scale=static.scale,
                                  softcap=static.softcap, alibi_slopes=alibi, mask=mask,
                                  sinks=sinks)
    return _host_copy(static.fn, lambda: _host_backward(do, q, k, v, o, lse, static, alibi,
                                                        mask, sinks, cu))


def _host_forward(q, k, v, static, alibi, mask, sinks, cu=None):
    score = dict(softcap=static.softcap, alibi_slopes=_numpy(alibi), sinks=_numpy(sinks))
    opts = dict(causal=static.causal, window=static.window, scale=static.scale, return_lse=True,
                backend=static.backend)
    if cu is None:
        o, lse = _api.attention(q, k, v, mask=_numpy(mask), **score, **opts)
    else:
        o, lse = _api.attention_varlen(q, k, v, *cu, **score, **opts)
    return _mlx(o), _mlx(lse)


def _host_backward(do, q, k, v, o, lse, static, alibi, mask, sinks, cu=None):
    score = dict(softcap=static.softcap, alibi_slopes=_numpy(alibi), sinks=_numpy(sinks))
    opts = dict(causal=static.causal, window=static.window, scale=static.scale,
                backend=static.backend)
    if cu is None:
        grads = _api.attention_backward(do, q, k, v, o, lse, mask=_numpy(mask), **score, **opts)
    else:
        grads = _api.attention_varlen_backward(do, q, k, v, o, lse, *cu, **score, **opts)
    return tuple(_mlx(np.asarray(g)) for g in grads)


# ---- The gradients of an additive mask and of ALiBi slopes: MLX's unfused math ------

def _score_gradient(q, k, v, o, lse, do, static, alibi, mask):
    """dL/ds for the final scores s (B, H, Tq, Tk) (after softcap, ALiBi and
    the mask): P (dP - delta), with delta from o as the fused backward
    takes it; and the |p - j| distances. Lazy MLX arrays."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    f32 = [x.astype(mx.float32) for x in (q, k, v, o, do)]
    q, k, v, o, do = f32
    k, v = (mx.repeat(x, H // Hkv, axis=2) for x in (k, v))
    s = mx.einsum("bqhd,bkhd->bhqk", q * static.scale, k)
    if static.softcap:
        s = static.softcap * mx.tanh(s / static.softcap)
    distance = mx.array(np.abs(np.arange(Tq)[:, None] + Tk - Tq - np.arange(Tk)[None, :]),
                        dtype=mx.float32)
    if alibi is not None:
        s = s - alibi.reshape(-1, H, 1, 1) * distance
    if mask is not None:
        s = mx.where(mask, s, -np.inf) if mask.dtype == mx.bool_ else s + mask
    band = reference.visible_keys(Tq, Tk, causal=static.causal, window=static.window)
    s = mx.where(mx.array(band), s, -np.inf)
    lse = lse[..., None]
    p = mx.where(lse == -np.inf, 0.0, mx.exp(s - mx.where(lse == -np.inf, 0.0, lse)))
    dp = mx.einsum("bqhd,bkhd->bhqk", do, v)
    delta = mx.sum(do * o, axis=-1).transpose(0, 2, 1)[..., None]
    return p * (dp - delta), distance


def _reduce_to(x, shape):
    """x summed over the axes where ``shape`` (as long as x's) has 1."""
    axes = [a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1]
    return mx.sum(x, axis=axes, keepdims=True) if axes else x


def _option_gradients(q, k, v, o, lse, do, static, alibi, mask):
    """(dalibi, dmask), each None where not given; a bool mask has none."""
    ds, distance = _score_gradient(q, k, v, o, lse, do, static, alibi, mask)
    dalibi = dmask = None
    if alibi is not None:
        dalibi = -mx.sum(ds * distance, axis=(2, 3))  # (B, H)
        dalibi = mx.sum(dalibi, axis=0) if alibi.ndim == 1 else dalibi
    if mask is not None:
        dmask = (mx.zeros(mask.shape, mx.float32) if mask.dtype == mx.bool_ else
                 _reduce_to(ds, mask.shape).reshape(mask.shape))
    return dalibi, dmask


def _varlen_alibi_gradient(q, k, v, o, lse, do, static, alibi, cu):
    """The (batch, H) slopes' gradient of a varlen call, one sequence at a time."""
    rows = []
    for b in range(len(cu[0]) - 1):
        (q0, q1), (k0, k1) = (int(cu[0][b]), int(cu[0][b + 1])), (int(cu[1][b]), int(cu[1][b + 1]))
        if q0 == q1 or k0 == k1:
            rows.append(mx.zeros((1, q.shape[1]), mx.float32))
            continue
        part = [x[q0:q1][None] for x in (q, o, do)]
        dalibi, _ = _option_gradients(part[0], k[k0:k1][None], v[k0:k1][None], part[1],
                                      lse[:, q0:q1][None], part[2], static,
                                      alibi[b:b + 1], None)
        rows.append(dalibi)
    return mx.concatenate(rows, axis=0)


# ---- The differentiable function -------------------------------------------------------

class _Static:
    """The options that are not arrays, and which option arrays come after
    q, k, v (in the order sinks, alibi, mask)."""

    def __init__(self, fn, causal, window, scale, softcap, backend, sinks, alibi, mask):
        self.fn = fn  # the entry point, for errors
        self.causal, self.window, self.scale, self.softcap = causal, window, scale, softcap
        self.backend, self.sinks, self.alibi, self.mask = backend, sinks, alibi, mask


def _split(static: _Static, extras):
    extras = list(extras)
    sinks = extras.pop(0) if static.sinks else None
    alibi = extras.pop(0) if static.alibi else None
    mask = extras.pop(0) if static.mask else None
    return sinks, alibi, mask


def _attend(static: _Static, cu=None):
    """A custom_function (q, k, v, *options) -> (o, lse)."""

    @mx.custom_function
    def attend(q, k, v, *extras):
        sinks, alibi, mask = _split(static, extras)
        return _compute_forward(q, k, v, static, alibi, mask, sinks, cu)

    @attend.vjp
    def attend_vjp(primals, cotangents, outputs):
        q, k, v, *extras = primals
        sinks, alibi, mask = _split(static, extras)
        do = cotangents[0]  # lse's cotangent is 0: lse leaves as stop_gradient(lse)
        o, lse = outputs
        grads = _compute_backward(do.astype(o.dtype), q, k, v, o, lse, static, alibi, mask,
                                  sinks, cu)
        out = list(grads[:3]) + ([grads[3]] if static.sinks else [])
        if static.alibi or static.mask:
            if cu is None:
                dalibi, dmask = _option_gradients(q, k, v, o, lse, do, static, alibi, mask)
            else:
                dalibi, dmask = _varlen_alibi_gradient(q, k, v, o, lse, do, static, alibi,
                                                       cu), None
            out += [x for x, given in ((dalibi, static.alibi), (dmask, static.mask)) if given]
        return tuple(out)

    return attend


# ---- Checks ------------------------------------------------------------------------

def _check_arrays(fn: str, arrays: dict, ndim: int, words: str) -> None:
    _wrappers.check_arrays(fn, arrays, ndim, words, is_array=lambda x: isinstance(x, mx.array),
                           kind="an mlx.core.array", astype="mx.float32")


def _option(fn: str, name: str, x):
    if x is not None and not isinstance(x, mx.array):
        raise TypeError(f"{fn}: {name} must be an mlx.core.array or None, got {type(x).__name__}")
    return x


def _backend(fn: str, backend):
    if backend is not None and backend not in _api.backends():
        raise ValueError(f"{fn}: unknown backend {backend!r}; available here: {_api.backends()}")
    return backend


# ---- The FlashAttention-style entry points ----------------------------------------------

def attention(q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
              alibi_slopes=None, mask=None, sinks=None, return_lse=False, layout="bthd",
              backend=None):
    """Exact softmax attention, fused, differentiable through the fused backward.

    Layout: q (B, Tq, H, D), k and v (B, Tk, Hkv, D) with ``layout="bthd"``
    (the default, FlashAttention's); MLX's (B, H, Tq, D) and (B, Hkv, Tk, D)
    with ``layout="bhtd"``. Returns o in q's layout and dtype, or (o, lse)
    with ``return_lse=True`` (lse (B, H, Tq) float32, under stop_gradient).

    Same contract and options as ``flashattn.attention``: float32, float16,
    bfloat16; ``alibi_slopes`` (H,) or (B, H) and ``sinks`` (H,) float32,
    ``mask`` bool or float32 broadcastable to (B, H, Tq, Tk). Gradients reach
    q, k, v and sinks (fused), and an additive mask and the slopes (MLX's
    unfused math, when asked for).
    """
    fn = "flashattn.mlx.attention"
    _check_arrays(fn, {"q": q, "k": k, "v": v}, 4, "(B, T, heads, D) or (B, heads, T, D)")
    opts = _wrappers.options(fn, causal=causal, window=window, scale=scale, softcap=softcap,
                             return_lse=return_lse, layout=layout)
    alibi_slopes, mask, sinks = (_option(fn, n, x) for n, x in (
        ("alibi_slopes", alibi_slopes), ("mask", mask), ("sinks", sinks)))
    B, Tq, H, D, Tk = _wrappers.check_shapes(fn, q.shape, k.shape, v.shape, opts)
    _wrappers.score_shapes(fn, B, H, Tq, Tk, alibi_slopes=alibi_slopes, mask=mask, sinks=sinks)
    if opts.layout == "bhtd":
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    static = _Static(fn, opts.causal, opts.window, opts.resolved_scale(D), opts.softcap,
                     _backend(fn, backend), sinks is not None, alibi_slopes is not None,
                     mask is not None)
    extras = [x for x in (sinks, alibi_slopes, mask) if x is not None]
    o, lse = _attend(static)(q, k, v, *extras)
    if opts.layout == "bhtd":
        o = o.swapaxes(1, 2)
    return (o, mx.stop_gradient(lse)) if opts.return_lse else o


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, window=(-1, -1), scale=None, softcap=0.0,
                     alibi_slopes=None, sinks=None, return_lse=False, backend=None):
    """Attention over packed sequences of different lengths
    (``flash_attn_varlen_func``'s semantics), differentiable.

    Layout: q (total_q, H, D), k and v (total_k, Hkv, D); ``cu_seqlens_q``
    and ``cu_seqlens_k`` (batch + 1,) int32 (or int64 that fits) prefix sums
    (MLX or NumPy arrays). Returns o (total_q, H, D), or (o, lse) with lse
    (H, total_q) float32. The options are ``attention``'s (no mask);
    alibi_slopes (H,) or (batch, H).
    """
    fn = "flashattn.mlx.attention_varlen"
    _check_arrays(fn, {"q": q, "k": k, "v": v}, 3, "(total, heads, D)")
    opts = _wrappers.options(fn, causal=causal, window=window, scale=scale, softcap=softcap,
                             return_lse=return_lse)
    _wrappers.check_varlen_shapes(fn, q.shape, k.shape, v.shape, opts)
    shaped = [np.broadcast_to(np.empty((), bool), tuple(x.shape)) for x in (q, k)]
    cu = _args.varlen_sequences(fn, *shaped, np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k),
                                max_seqlen_q, max_seqlen_k)
    batch, H, D = cu[0].shape[0] - 1, q.shape[1], q.shape[2]
    alibi_slopes, sinks = (_option(fn, n, x) for n, x in (("alibi_slopes", alibi_slopes),
                                                         ("sinks", sinks)))
    _wrappers.score_shapes(fn, batch, H, 1, 1, alibi_slopes=alibi_slopes, sinks=sinks)
    if alibi_slopes is not None and alibi_slopes.ndim == 1:
        alibi_slopes = mx.broadcast_to(alibi_slopes, (batch, H))
    static = _Static(fn, opts.causal, opts.window, opts.resolved_scale(D), opts.softcap,
                     _backend(fn, backend), sinks is not None, alibi_slopes is not None, False)
    extras = [x for x in (sinks, alibi_slopes) if x is not None]
    o, lse = _attend(static, cu)(q, k, v, *extras)
    return (o, mx.stop_gradient(lse)) if opts.return_lse else o


# ---- The drop-in for mx.fast.scaled_dot_product_attention --------------------------------

def scaled_dot_product_attention(q, k, v, *, scale, mask=None, sinks=None, force_fused=False,
                                 stream=None):
    """``mx.fast.scaled_dot_product_attention`` computed by flashattn.

    MLX's layout and semantics: q (B, N_q, T_q, D), k and v (B, N_kv, T_kv,
    D), N_q a multiple of N_kv; ``scale`` required; ``mask`` "causal"
    (aligned bottom-right: the last query with the last key), or a bool
    (True: takes part) or additive array of at most 4 dimensions,
    broadcastable to (B, N_q, T_q, T_kv); ``sinks`` (N_q,). Returns
    (B, N_q, T_q, D) in q's dtype, differentiable (the fused backward; an
    additive mask's gradient by MLX's math when asked for). A row that sees
    no key gets the mean of the values, as MLX gives for a bool or causal
    mask (MLX gives NaN where an additive mask is -inf over a whole row).
    A float mask and the sinks are used as float32. ``force_fused`` and
    ``stream`` are accepted and ignored: flashattn's computation is fused.
    """
    fn = "flashattn.mlx.scaled_dot_product_attention"
    _check_arrays(fn, {"q": q, "k": k, "v": v}, 4, "(B, heads, T, D)")
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"{fn}: mask must be 'causal', an array or None, got {mask!r}")
    mask = None if causal else _option(fn, "mask", mask)
    if mask is not None:
        if mask.ndim > 4:
            raise ValueError(f"{fn}: mask must have at most 4 dimensions, got shape "
                             f"{tuple(mask.shape)}")
        if mask.dtype != mx.bool_:
            mask = mask.astype(mx.float32)
    if sinks is not None:
        sinks = _option(fn, "sinks", sinks).astype(mx.float32)
    o, lse = attention(q, k, v, causal=causal, scale=float(scale), mask=mask, sinks=sinks,
                       layout="bhtd", return_lse=True)
    N, Nkv = q.shape[1], k.shape[1]
    mean_v = mx.repeat(mx.mean(v.astype(mx.float32), axis=2, keepdims=True), N // Nkv, axis=1)
    return mx.where((lse == -np.inf)[..., None], mean_v.astype(o.dtype), o)
