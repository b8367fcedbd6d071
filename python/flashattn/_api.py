"""The public entry points: argument checks that belong to Python (types,
dtypes, memory layout), then one call into the compiled core, which checks
shapes and runs the chosen engine with the GIL released."""

from __future__ import annotations

import numpy as np

from . import _main_interpreter  # first: refuses a subinterpreter before _core loads
from . import _args, _core, _dtypes
from ._arrays import host_array
from .memory import _contiguous_copy

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "backends", "set_num_threads", "get_num_threads"]


def backends() -> list[str]:
    """The engines usable on this machine, best first (the first is the default).

    ``'metal'`` (Apple GPU) where available, ``'cpu'`` everywhere, and
    ``'metal-sim'``: the Metal kernels run on the CPU, slowly, for testing.
    """
    return list(_core.backends())


def set_num_threads(n: int) -> None:
    """Threads used by the cpu engine, 1 to 1024 (default: all cores, or
    ``FLASHATTN_NUM_THREADS``). Waits for running cpu calls to finish, with
    the GIL released; raises RuntimeError, keeping the previous count, when
    the system cannot start that many threads."""
    _core.set_num_threads(_args.num_threads("set_num_threads", n))


def get_num_threads() -> int:
    """Threads used by the cpu engine."""
    return int(_core.get_num_threads())


def _dtype_error(fn: str, name: str, dtype) -> TypeError:
    if dtype.kind == "f" and not dtype.isnative:
        return TypeError(f"{fn}: {name} has non-native byte order ({dtype.str}); convert with "
                         f"{name}.astype(np.{dtype.newbyteorder('=').name})")
    return TypeError(f"{fn}: {name} must be float32, float16 or bfloat16 (ml_dtypes), got "
                     f"{dtype}; convert with {name}.astype(np.float32) (nothing is cast for you)")


def _input(fn: str, name: str, x, floats_only: bool = False) -> np.ndarray:
    """x as a float32, float16 or bfloat16 array (float32 only with
    floats_only: lse) whose last axis is contiguous: in place when it already
    is (a slice of a packed qkv array is not copied), else one copy. Arrays of
    other libraries in host memory are viewed as NumPy arrays first."""
    if isinstance(x, (np.ndarray, np.generic)):
        x = _args.array(fn, name, x)  # masked arrays and NumPy scalars are refused
    x = host_array(fn, name, x)  # torch, JAX, MLX, DLPack, buffers: viewed, not copied
    if floats_only and x.dtype != np.float32:
        if x.dtype.kind == "f" and x.dtype.itemsize == 4:
            raise _dtype_error(fn, name, x.dtype)
        raise TypeError(f"{fn}: {name} must be float32 (lse always is), got {x.dtype}; "
                        f"convert with {name}.astype(np.float32)")
    if _dtypes.name_of(x.dtype) is None:
        raise _dtype_error(fn, name, x.dtype)
    if x.size == 0:
        return x  # nothing is read: its strides do not matter
    size = x.dtype.itemsize
    in_place = (
        x.flags.aligned
        and all(s % size == 0 for s in x.strides)
        and (x.ndim == 0 or x.shape[-1] <= 1 or x.strides[-1] == size)
    )
    return x if in_place else _contiguous_copy(x)


def _one_dtype(fn: str, arrays: dict) -> str:
    """The call's dtype name: every array of ``arrays`` (q, k, v, and do, o
    in the backward) must share q's, else TypeError naming each."""
    dtypes = {name: x.dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        seen = ", ".join(f"{name} is {dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"{fn}: q, k and v must share one dtype (and do, o have q's); {seen}. "
                        f"Convert them with .astype(), e.g. .astype(q.dtype)")
    return _dtypes.name_of(dtypes["q"])


def _raw(x: np.ndarray) -> np.ndarray:
    """x as _core takes it: float32 as it is, 16-bit floats as their uint16 bits."""
    return x if x.dtype == np.float32 else x.view(np.uint16)


def _cooked(x: np.ndarray, dtype: str) -> np.ndarray:
    """An output of _core (float32, or uint16 bits) in the call's dtype."""
    return x if dtype == "float32" else x.view(_dtypes.numpy_dtype(dtype))


def _backend(fn: str, backend) -> str | None:
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"{fn}: backend must be a str or None, got {type(backend).__name__}")
    available = backends()
    if backend not in available:
        from ._engines import missing  # why a known engine is not here (metal off a Mac)

        reason = missing().get(backend)
        if reason is not None:
            raise ValueError(f"{fn}: backend {backend!r} is not available here ({reason[0]}); "
                             f"available here: {available}")
        raise ValueError(f"{fn}: unknown backend {backend!r}; available here: {available}")
    return backend


def _score_options(fn: str, q: np.ndarray, k: np.ndarray, softcap, alibi_slopes, mask,
                   sinks) -> dict:
    """The score options checked (the reference runs the same checks) and
    as _core takes them: the slopes as a (B, H) view, the mask as a
    broadcast (B, H, Tq, Tk) view, a bool mask viewed as bytes."""
    if q.ndim != 4 or k.ndim != 4:  # the core reports the shapes before it reads any option
        return dict(softcap=_args.softcap(fn, softcap))
    B, Tq, H, _ = q.shape
    Tk = k.shape[1]
    out = dict(softcap=_args.softcap(fn, softcap),
               alibi_slopes=_args.alibi_slopes(fn, alibi_slopes, B, H),
               sinks=_args.sinks(fn, sinks, H), mask_bool=None, mask_float=None)
    mask = _args.mask(fn, mask, B, H, Tq, Tk)
    if mask is not None and mask.dtype == np.bool_:
        out["mask_bool"] = mask.view(np.uint8)
    elif mask is not None:
        out["mask_float"] = mask
    return out


def attention(q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
              alibi_slopes=None, mask=None, sinks=None, return_lse=False, layout="bthd",
              backend=None):
    """Exact softmax attention, fused: memory O(B·H·T), never O(T²).

    Layout: q (B, Tq, H, D), k and v (B, Tk, Hkv, D) (FlashAttention's,
    ``layout="bthd"``, the default); ``layout="bhtd"`` takes torch's and
    MLX's (B, H, Tq, D), (B, Hkv, Tk, D) in place and returns o so.

    Args:
        q: (B, Tq, H, D) float32, float16 or ml_dtypes.bfloat16.
        k, v: (B, Tk, Hkv, D) of q's dtype; H must be a multiple of Hkv, and query
            head h reads kv head h // (H // Hkv) (GQA; Hkv == 1 is MQA).
        causal: mask aligned bottom-right: query i sits at key position
            p = i + Tk - Tq and sees keys j <= p.
        window: (left, right): query at position p sees keys
            p - left <= j <= p + right; -1 is unbounded. Causal caps right at 0.
        scale: multiplies q·k; default 1/sqrt(D).
        softcap: when > 0, each score s = scale·q·k becomes
            softcap·tanh(s / softcap) (FlashAttention-2, Gemma), before any bias.
        alibi_slopes: float32 (H,) or (B, H): adds -slope·|p - j| to the score.
        mask: bool (True: may attend) or float32 (added to the score), any
            shape broadcastable to (B, H, Tq, Tk); read in place, never expanded.
        sinks: float32 (H,): one extra logit per head in every row's softmax
            denominator, with a zero value vector (gpt-oss, MLX); lse includes it.
        return_lse: also return the log-sum-exp of the scores.
        layout: "bthd" (default) or "bhtd", as above; lse and mask are the
            same in both.
        backend: an engine from backends(); default the first.

    Returns:
        o, (B, Tq, H, D) in q's dtype (a (B, H, Tq, D) view of it with
        ``layout="bhtd"``), or (o, lse) with lse (B, H, Tq) float32
        (natural log). A row that sees no key gets o = 0 and lse = -inf
        (lse = its sink, with sinks).

    Inputs whose last axis is contiguous are read in place whatever their other
    strides; other layouts are copied once. Scores, softmax statistics and
    accumulators are float32 in every dtype; o is rounded to q's dtype once.
    Other dtypes (float64 too), or q, k, v of different dtypes, raise
    TypeError: nothing is cast for you.
    """
    fn = "attention"
    layout = _args.layout(fn, layout)
    q, k, v = (_args.to_bthd(_input(fn, name, x), layout)
               for name, x in (("q", q), ("k", k), ("v", v)))
    dtype = _one_dtype(fn, {"q": q, "k": k, "v": v})
    causal, return_lse = _args.flag(fn, "causal", causal), _args.flag(fn, "return_lse", return_lse)
    left, right = _args.window(fn, window)
    score = _score_options(fn, q, k, softcap, alibi_slopes, mask, sinks)
    o, lse = _core.forward(_raw(q), _raw(k), _raw(v), causal, left, right, _args.scale(fn, scale),
                           backend=_backend(fn, backend), dtype=dtype, **score)
    o = _args.to_bthd(_cooked(o, dtype), layout)
    return (o, lse) if return_lse else o


def attention_backward(do, q, k, v, o, lse, *, causal=False, window=(-1, -1), scale=None,
                       softcap=0.0, alibi_slopes=None, mask=None, sinks=None, layout="bthd",
                       backend=None):
    """Gradients of attention(q, k, v, ...) for the output gradient ``do``.

    Layout as attention's: (B, Tq, H, D) and (B, Tk, Hkv, D) for do, q, o
    and k, v with ``layout="bthd"`` (default), (B, H, Tq, D) and
    (B, Hkv, Tk, D) with ``"bhtd"``; lse is (B, H, Tq) in both.
    ``o`` and ``lse`` are the outputs of the forward call with the same options
    (``attention(..., return_lse=True)``); probabilities are recomputed from
    them tile by tile (FlashAttention-2), so memory stays O(B·H·T).

    Returns:
        dq, dk, dv: in q's dtype (do and o must have it too; lse is
        float32), shaped like q, k, v, and dsinks (H,) float32 when
        ``sinks`` is given. Rows that saw no key contribute zero gradient.
    """
    fn = "attention_backward"
    layout = _args.layout(fn, layout)
    arrays = {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}
    do, q, k, v, o, lse = (_input(fn, name, x, floats_only=name == "lse")
                           for name, x in arrays.items())
    do, q, k, v, o = (_args.to_bthd(x, layout) for x in (do, q, k, v, o))
    dtype = _one_dtype(fn, {"q": q, "k": k, "v": v, "do": do, "o": o})
    if not lse.flags.c_contiguous:
        lse = _contiguous_copy(lse)  # (B, H, Tq): O(B·H·T) at most
    causal = _args.flag(fn, "causal", causal)
    left, right = _args.window(fn, window)
    score = _score_options(fn, q, k, softcap, alibi_slopes, mask, sinks)
    grads = _core.backward(_raw(do), _raw(q), _raw(k), _raw(v), _raw(o), lse, causal, left, right,
                           _args.scale(fn, scale), backend=_backend(fn, backend), dtype=dtype,
                           **score)
    return tuple(_args.to_bthd(_cooked(g, dtype), layout) for g in grads[:3]) + tuple(grads[3:])


def _varlen_arguments(fn, arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softcap, alibi_slopes, sinks):
    """The arrays as _input makes them, the prefix sums checked, the options
    as _core takes them (slopes (batch, H))."""
    arrays = {name: _input(fn, name, x, floats_only=name == "lse") for name, x in arrays.items()}
    dtype = _one_dtype(fn, {name: x for name, x in arrays.items() if name != "lse"})
    q, k = arrays["q"], arrays["k"]
    cu_q, cu_k = _args.varlen_sequences(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k)
    batch, H = cu_q.shape[0] - 1, q.shape[1]
    score = dict(softcap=_args.softcap(fn, softcap),
                 alibi_slopes=_args.alibi_slopes(fn, alibi_slopes, batch, H),
                 sinks=_args.sinks(fn, sinks, H), dtype=dtype)
    arrays = {name: x if name == "lse" else _raw(x) for name, x in arrays.items()}
    return arrays, cu_q, cu_k, score


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, window=(-1, -1), scale=None, softcap=0.0,
                     alibi_slopes=None, sinks=None, return_lse=False, backend=None):
    """Attention over a batch of sequences of different lengths, packed
    (flash_attn_varlen_func's semantics).

    Args:
        q: (total_q, H, D) float32, float16 or bfloat16; k, v: (total_k,
            Hkv, D) of q's dtype.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) prefix sums starting at
            0: sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and
            cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v.
        max_seqlen_q, max_seqlen_k: accepted for flash_attn's signature; when
            given, at least the longest sequence.
        alibi_slopes: float32 (H,) or (batch, H).
        The other options are attention()'s, applied within each sequence
        (causal bottom-right in each). Work is the sum of Tq_b·Tk_b.

    Returns:
        o (total_q, H, D), or (o, lse) with lse (H, total_q).
    """
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             causal, window, scale, softcap, alibi_slopes, sinks, return_lse,
                             backend)


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                      window, scale, softcap, alibi_slopes, sinks, return_lse, backend,
                      per_sequence=False):
    """attention_varlen; per_sequence runs one engine call per sequence (the
    bench's and the tests' baseline) instead of one for the batch."""
    fn = "attention_varlen"
    arrays, cu_q, cu_k, score = _varlen_arguments(
        fn, {"q": q, "k": k, "v": v}, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softcap, alibi_slopes, sinks)
    causal, return_lse = _args.flag(fn, "causal", causal), _args.flag(fn, "return_lse", return_lse)
    left, right = _args.window(fn, window)
    o, lse = _core.forward_varlen(arrays["q"], arrays["k"], arrays["v"], cu_q, cu_k, causal, left,
                                  right, _args.scale(fn, scale), backend=_backend(fn, backend),
                                  _per_sequence=per_sequence, **score)
    o = _cooked(o, score["dtype"])
    return (o, lse) if return_lse else o


def attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, causal=False,
                              window=(-1, -1), scale=None, softcap=0.0, alibi_slopes=None,
                              sinks=None, backend=None):
    """Gradients of attention_varlen(q, k, v, ...) for ``do``; ``o`` and
    ``lse`` (H, total_q) from the forward call with the same options.
    Returns dq, dk, dv shaped like q, k, v, and dsinks (H,) with ``sinks``."""
    return _attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, causal, window, scale, softcap,
                                      alibi_slopes, sinks, backend)


def _attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, causal, window, scale, softcap, alibi_slopes, sinks,
                               backend, per_sequence=False):
    """attention_varlen_backward; per_sequence as in _attention_varlen."""
    fn = "attention_varlen_backward"
    arrays, cu_q, cu_k, score = _varlen_arguments(
        fn, {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, softcap, alibi_slopes, sinks)
    causal = _args.flag(fn, "causal", causal)
    left, right = _args.window(fn, window)
    lse = arrays["lse"]
    if lse.shape != (arrays["q"].shape[1], arrays["q"].shape[0]):
        raise ValueError(f"{fn}: lse must have shape (H, total_q) = "
                         f"{(arrays['q'].shape[1], arrays['q'].shape[0])}, got {lse.shape}")
    grads = _core.backward_varlen(arrays["do"], arrays["q"], arrays["k"], arrays["v"],
                                  arrays["o"], np.ascontiguousarray(lse), cu_q, cu_k, causal,
                                  left, right, _args.scale(fn, scale),
                                  backend=_backend(fn, backend), _per_sequence=per_sequence,
                                  **score)
    return tuple(_cooked(g, score["dtype"]) for g in grads[:3]) + tuple(grads[3:])
