"""flashattn for PyTorch: differentiable attention with the fused backward.

Layouts: ``attention`` takes q (B, Tq, H, D), k and v (B, Tk, Hkv, D)
(FlashAttention's, ``layout="bthd"``, the default) or torch's (B, H, Tq, D)
with ``layout="bhtd"``; ``attention_varlen`` packed (total, H, D);
``scaled_dot_product_attention`` is a drop-in for torch's, with torch's
(..., H, T, D) and semantics.

    import flashattn.torch as fat
    o = fat.attention(q, k, v, causal=True)                 # (B, T, H, D)
    o = fat.attention(q, k, v, causal=True, layout="bhtd")  # torch's (B, H, T, D)
    o = fat.scaled_dot_product_attention(q, k, v, is_causal=True)  # as F.sdpa

float32, float16 and bfloat16, with every option of ``flashattn.attention``
(causal, window, scale, softcap, alibi_slopes, mask, sinks, return_lse).
``attention`` calls the custom op ``torch.ops.flashattn.attention``
(``torch.library``), whose autograd formula saves o and the log-sum-exp and
calls ``torch.ops.flashattn.attention_backward``, the fused backward;
gradients reach q, k, v and sinks. All ops have fake implementations, so
``torch.compile(fullgraph=True)`` traces them without a graph break.

Devices and copies:

- CPU tensors are read in place through DLPack (any strides whose last axis
  is contiguous; ``layout="bhtd"`` is a transposed view; bfloat16 is read as
  its int16 bits); outputs are the engine's buffers, wrapped without a copy;
  the GIL is released while the engine runs.
- MPS tensors (Mac), where torch has ``torch.mps.compile_shader`` (2.7 and
  later) and ``backend=None``: in torch's own MPS stream (flashattn._instream,
  docs/metal.md): the metal engine's kernels, compiled by torch from the
  shipped shaders, run on the tensors where they are, outputs allocated by
  torch; nothing is copied to the host and nothing waits (varlen calls take
  the copying path below).
- MPS tensors otherwise (an older torch, ``backend=`` naming an engine, or
  varlen): each input is copied to the CPU once and each output back once
  (O(B·T·H·D) per call, never O(T²)); the engine computes.
- float64 runs on ``flashattn.reference`` (NumPy, float64): slow and exact,
  for ``torch.autograd.gradcheck``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from . import _api, _args, _wrappers, reference
from ._wrappers import require as _require
torch = _require("torch", "torch", "flashattn.torch")

from ._instream import torch_stream as _instream  # noqa: E402  (imports torch)

from .distributed._torch import ring_attention  # noqa: E402  issue 18: over MPI

__all__ = ["attention", "attention_varlen", "scaled_dot_product_attention", "ring_attention"]

Tensor = torch.Tensor
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ENGINES = tuple(_api.backends())  # read once: torch.compile cannot trace into the extension


# ---- Between tensors and the NumPy API ----------------------------------------

def _host(x: Optional[Tensor]):
    """x as the NumPy API reads it: a CPU tensor in place, else one copy."""
    if x is None:
        return None
    x = x.detach()
    return x if x.device.type == "cpu" else x.cpu()


def _tensor(a: np.ndarray, device: torch.device) -> Tensor:
    """A NumPy result as a tensor on ``device``, without a copy on the CPU."""
    if a.dtype.name == "bfloat16":  # ml_dtypes': torch reads its bits
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)


def _numpy(x: Optional[Tensor]):
    """A score option (float32 or bool) or a float64 input as a NumPy array."""
    return None if x is None else _host(x).numpy()


# ---- The compute: one function per direction ---------------------------------
# Each takes and returns tensors in the bthd layout and is the only place that
# reaches an engine (issue 35 puts the in-stream MPS path here).

def _stream_host(q, backend, cu_seqlens):
    """The in-stream MPS host for this call (MPS tensors, torch >= 2.7, no
    engine named, not varlen, not float64), else None."""
    if backend is not None or cu_seqlens is not None or q.dtype == torch.float64:
        return None
    return _instream.host(q.device)


def _compute_forward(q, k, v, causal, window, scale, softcap, alibi, mask, sinks, backend,
                     cu_seqlens=None):
    host = _stream_host(q, backend, cu_seqlens)
    if host is not None:  # in torch's MPS stream (flashattn._instream)
        return _instream.forward(host, q, k, v, causal=causal, window=window, scale=scale,
                                 softcap=softcap, alibi_slopes=alibi, mask=mask, sinks=sinks)
    args = [_host(x) for x in (q, k, v)]
    score = dict(softcap=softcap, alibi_slopes=_numpy(alibi), sinks=_numpy(sinks))
    if cu_seqlens is None:
        score["mask"] = _numpy(mask)
    opts = dict(causal=causal, window=window, scale=scale, return_lse=True)
    if q.dtype == torch.float64:
        args = [_numpy(x) for x in args]
        if cu_seqlens is None:
            o, lse = reference.attention(*args, **opts, **score)
        else:
            o, lse = reference.attention_varlen(*args, *cu_seqlens, **opts, **score)
        lse = lse.astype(np.float32)
    elif cu_seqlens is None:
        o, lse = _api.attention(*args, **opts, **score, backend=backend)
    else:
        o, lse = _api.attention_varlen(*args, *cu_seqlens, **opts, **score, backend=backend)
    return _tensor(o, q.device), _tensor(lse, q.device)


def _compute_backward(do, q, k, v, o, lse, causal, window, scale, softcap, alibi, mask, sinks,
                      backend, cu_seqlens=None):
    host = _stream_host(q, backend, cu_seqlens)
    if host is not None:
        return _instream.backward(host, do, q, k, v, o, lse, causal=causal, window=window,
                                  scale=scale, softcap=softcap, alibi_slopes=alibi, mask=mask,
                                  sinks=sinks)
    args = [_host(x) for x in (do, q, k, v, o, lse)]
    score = dict(softcap=softcap, alibi_slopes=_numpy(alibi), sinks=_numpy(sinks))
    if cu_seqlens is None:
        score["mask"] = _numpy(mask)
    opts = dict(causal=causal, window=window, scale=scale)
    if q.dtype == torch.float64:
        args = [_numpy(x) for x in args]
        if cu_seqlens is None:
            grads = reference.attention_backward(*args, **opts, **score)
        else:
            grads = reference.attention_varlen_backward(*args, *cu_seqlens, **opts, **score)
    elif cu_seqlens is None:
        grads = _api.attention_backward(*args, **opts, **score, backend=backend)
    else:
        grads = _api.attention_varlen_backward(*args, *cu_seqlens, **opts, **score,
                                               backend=backend)
    return tuple(_tensor(np.asarray(g), q.device) for g in grads)


# ---- The custom ops -------------------------------------------------------------

def _no_sinks(q: Tensor) -> Tensor:
    return q.new_zeros((0,), dtype=torch.float32)


@torch.library.custom_op("flashattn::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, window_left: int,
                  window_right: int, scale: Optional[float], softcap: float,
                  alibi_slopes: Optional[Tensor], mask: Optional[Tensor], sinks: Optional[Tensor],
                  backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    return _compute_forward(q, k, v, causal, (window_left, window_right), scale, softcap,
                            alibi_slopes, mask, sinks, backend)


@_attention_op.register_fake
def _(q, k, v, causal, window_left, window_right, scale, softcap, alibi_slopes, mask, sinks,
      backend):
    B, Tq, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, Tq), dtype=torch.float32)


@torch.library.custom_op("flashattn::attention_backward", mutates_args=())
def _attention_backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                           causal: bool, window_left: int, window_right: int,
                           scale: Optional[float], softcap: float, alibi_slopes: Optional[Tensor],
                           mask: Optional[Tensor], sinks: Optional[Tensor],
                           backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = _compute_backward(do, q, k, v, o, lse, causal, (window_left, window_right), scale,
                              softcap, alibi_slopes, mask, sinks, backend)
    return grads if len(grads) == 4 else (*grads, _no_sinks(q))  # dsinks: (0,) without sinks


@_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, causal, window_left, window_right, scale, softcap, alibi_slopes,
      mask, sinks, backend):
    dsinks = _no_sinks(q) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


@torch.library.custom_op("flashattn::attention_varlen", mutates_args=())
def _attention_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, causal: bool, window_left: int, window_right: int,
                         scale: Optional[float], softcap: float, alibi_slopes: Optional[Tensor],
                         sinks: Optional[Tensor],
                         backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    cu = (cu_seqlens_q.cpu().numpy(), cu_seqlens_k.cpu().numpy())
    return _compute_forward(q, k, v, causal, (window_left, window_right), scale, softcap,
                            alibi_slopes, None, sinks, backend, cu_seqlens=cu)


@_attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right, scale, softcap,
      alibi_slopes, sinks, backend):
    total, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((H, total), dtype=torch.float32)


@torch.library.custom_op("flashattn::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward_op(
        do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor, causal: bool, window_left: int, window_right: int,
        scale: Optional[float], softcap: float, alibi_slopes: Optional[Tensor],
        sinks: Optional[Tensor], backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    cu = (cu_seqlens_q.cpu().numpy(), cu_seqlens_k.cpu().numpy())
    grads = _compute_backward(do, q, k, v, o, lse, causal, (window_left, window_right), scale,
                              softcap, alibi_slopes, None, sinks, backend, cu_seqlens=cu)
    return grads if len(grads) == 4 else (*grads, _no_sinks(q))


@_attention_varlen_backward_op.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right, scale,
      softcap, alibi_slopes, sinks, backend):
    dsinks = _no_sinks(q) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


# Autograd: the forward ops save o and lse (lse is returned without a
# gradient); the backward ops give dq, dk, dv and dsinks. A mask or ALiBi
# slopes that require grad were refused before the op; checked again here
# for a direct call of the op.

def _refuse_option_gradients(ctx, names_at: dict) -> None:
    for name, i in names_at.items():
        if ctx.needs_input_grad[i]:
            raise RuntimeError(f"flashattn.torch: {name} requires grad, and flashattn computes "
                               f"no gradient for it; pass {name}.detach()")


def _setup(ctx, inputs, output):
    q, k, v, *options = inputs
    o, lse = output
    alibi, mask, sinks = options[5], options[6], options[7]
    ctx.save_for_backward(q, k, v, o, lse, alibi, mask, sinks)
    ctx.options = options[:5] + [options[8]]  # causal, left, right, scale, softcap; backend
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    _refuse_option_gradients(ctx, {"alibi_slopes": 8, "mask": 9})
    q, k, v, o, lse, alibi, mask, sinks = ctx.saved_tensors
    causal, left, right, scale, softcap, backend = ctx.options
    dq, dk, dv, dsinks = torch.ops.flashattn.attention_backward(
        do, q, k, v, o, lse, causal, left, right, scale, softcap, alibi, mask, sinks, backend)
    return (dq, dk, dv) + (None,) * 7 + (dsinks if sinks is not None else None, None)


_attention_op.register_autograd(_backward, setup_context=_setup)


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *options = inputs
    o, lse = output
    alibi, sinks = options[5], options[6]
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi, sinks)
    ctx.options = options[:5] + [options[7]]
    ctx.mark_non_differentiable(lse)


def _backward_varlen(ctx, do, _dlse):
    _refuse_option_gradients(ctx, {"alibi_slopes": 10})
    q, k, v, o, lse, cu_q, cu_k, alibi, sinks = ctx.saved_tensors
    causal, left, right, scale, softcap, backend = ctx.options
    dq, dk, dv, dsinks = torch.ops.flashattn.attention_varlen_backward(
        do, q, k, v, o, lse, cu_q, cu_k, causal, left, right, scale, softcap, alibi, sinks,
        backend)
    return (dq, dk, dv) + (None,) * 8 + (dsinks if sinks is not None else None, None)


_attention_varlen_op.register_autograd(_backward_varlen, setup_context=_setup_varlen)


# ---- The FlashAttention-style entry points --------------------------------------

def _check_tensors(fn: str, arrays: dict, ndim: int, layout_words: str) -> None:
    for name, x in arrays.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{fn}: {name} must be float32, float16 or bfloat16 (float64 runs on "
                            f"the reference), got {x.dtype}; convert with {name}.float()")
        if x.dim() != ndim:
            raise ValueError(f"{fn}: {name} must have {ndim} dimensions {layout_words}, got "
                             f"shape {tuple(x.shape)}")
    dtypes = {name: x.dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        seen = ", ".join(f"{name} is {d}" for name, d in dtypes.items())
        raise TypeError(f"{fn}: q, k and v must share one dtype; {seen}. Convert them with "
                        f".to(q.dtype)")


def _check_options(fn: str, q: Tensor, backend, alibi_slopes, mask, sinks) -> None:
    if backend is not None and backend not in _ENGINES:
        raise ValueError(f"{fn}: unknown backend {backend!r}; available here: {list(_ENGINES)}")
    if backend is not None and q.dtype == torch.float64:
        raise TypeError(f"{fn}: the engines run float32, float16 and bfloat16; float64 runs on "
                        f"the reference only (backend=None)")
    for name, x in (("alibi_slopes", alibi_slopes), ("mask", mask), ("sinks", sinks)):
        if x is not None and not isinstance(x, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got "
                            f"{type(x).__name__}")
    for name, x in (("alibi_slopes", alibi_slopes), ("mask", mask)):
        if x is not None and x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{fn}: {name} requires grad, and flashattn computes no gradient "
                               f"for it (only for q, k, v and sinks); pass {name}.detach()")


def _floats(q: Tensor):
    return ("float32", "float64") if q.dtype == torch.float64 else ("float32",)


def attention(q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
              alibi_slopes=None, mask=None, sinks=None, return_lse=False, layout="bthd",
              backend=None):
    """Exact softmax attention, fused, differentiable through the fused backward.

    Layout: q (B, Tq, H, D), k and v (B, Tk, Hkv, D) with ``layout="bthd"``
    (the default, FlashAttention's); torch's (B, H, Tq, D) and
    (B, Hkv, Tk, D) with ``layout="bhtd"``, read as transposed views.
    Returns o in q's layout and dtype, or (o, lse) with ``return_lse=True``
    (lse (B, H, Tq) float32, without a gradient).

    Same contract and options as ``flashattn.attention``: float32, float16,
    bfloat16 (float64 on the reference); ``alibi_slopes`` (H,) or (B, H) and
    ``sinks`` (H,) float32, ``mask`` bool or float32 broadcastable to
    (B, H, Tq, Tk). Gradients reach q, k, v and sinks; a mask or ALiBi slopes
    that require grad are refused.
    """
    fn = "flashattn.torch.attention"
    _check_tensors(fn, {"q": q, "k": k, "v": v}, 4, "(B, T, heads, D) or (B, heads, T, D)")
    opts = _wrappers.options(fn, causal=causal, window=window, scale=scale, softcap=softcap,
                             return_lse=return_lse, layout=layout)
    _check_options(fn, q, backend, alibi_slopes, mask, sinks)
    if not torch.compiler.is_compiling():  # the op checks again where it runs
        B, Tq, H, _, Tk = _wrappers.check_shapes(fn, q.shape, k.shape, v.shape, opts)
        _wrappers.score_shapes(fn, B, H, Tq, Tk, alibi_slopes=alibi_slopes, mask=mask,
                               sinks=sinks, float_names=_floats(q))
    if opts.layout == "bhtd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    o, lse = torch.ops.flashattn.attention(q, k, v, opts.causal, *opts.window, opts.scale,
                                           opts.softcap, alibi_slopes, mask, sinks, backend)
    if opts.layout == "bhtd":
        o = o.transpose(1, 2)
    return (o, lse) if opts.return_lse else o


def _shaped(x: Tensor) -> np.ndarray:
    """An array of x's shape that holds nothing (for the checks of shapes)."""
    return np.broadcast_to(np.empty((), np.bool_), tuple(x.shape))


def _prefix_sums(fn: str, name: str, cu) -> Tensor:
    if not isinstance(cu, Tensor) or cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: {name} must be an int32 (or int64) torch.Tensor, got "
                        f"{getattr(cu, 'dtype', type(cu).__name__)}")
    return cu


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, window=(-1, -1), scale=None, softcap=0.0,
                     alibi_slopes=None, sinks=None, return_lse=False, backend=None):
    """Attention over packed sequences of different lengths
    (``flash_attn_varlen_func``'s semantics), differentiable.

    Layout: q (total_q, H, D), k and v (total_k, Hkv, D); ``cu_seqlens_q``
    and ``cu_seqlens_k`` (batch + 1,) int32 (or int64) prefix sums. Returns
    o (total_q, H, D), or (o, lse) with lse (H, total_q) float32. The
    options are ``attention``'s (no mask), applied within each sequence.
    ``max_seqlen_*`` are accepted for flash_attn's signature.
    """
    fn = "flashattn.torch.attention_varlen"
    _check_tensors(fn, {"q": q, "k": k, "v": v}, 3, "(total, heads, D)")
    opts = _wrappers.options(fn, causal=causal, window=window, scale=scale, softcap=softcap,
                             return_lse=return_lse)
    _check_options(fn, q, backend, alibi_slopes, None, sinks)
    cu_q = _prefix_sums(fn, "cu_seqlens_q", cu_seqlens_q)
    cu_k = _prefix_sums(fn, "cu_seqlens_k", cu_seqlens_k)
    if not torch.compiler.is_compiling():
        _wrappers.check_varlen_shapes(fn, q.shape, k.shape, v.shape, opts)
        batch = cu_q.shape[0] - 1
        H = q.shape[1]
        _wrappers.score_shapes(fn, batch, H, 1, 1, alibi_slopes=alibi_slopes, sinks=sinks,
                               float_names=_floats(q))
        _args.varlen_sequences(fn, _shaped(q), _shaped(k), cu_q.cpu().numpy(),
                               cu_k.cpu().numpy(), max_seqlen_q, max_seqlen_k)
    o, lse = torch.ops.flashattn.attention_varlen(q, k, v, cu_q, cu_k, opts.causal, *opts.window,
                                                  opts.scale, opts.softcap, alibi_slopes, sinks,
                                                  backend)
    return (o, lse) if opts.return_lse else o


# ---- The drop-in for torch.nn.functional.scaled_dot_product_attention --------------

def _flat_batch(x: Tensor, batch: Tuple[int, ...]) -> Tensor:
    """x (*lead, a, b, c), its lead broadcastable to ``batch``, as
    (prod(batch), a, b, c), or (1, a, b, c) when its lead is all ones: a
    view where the strides allow."""
    lead = len(x.shape) - 3
    x = x.reshape((1,) * (len(batch) - lead) + tuple(x.shape))
    if all(s == 1 for s in x.shape[:len(batch)]):
        return x.reshape(1, *x.shape[len(batch):])
    return x.expand(*batch, *x.shape[len(batch):]).reshape(-1, *x.shape[len(batch):])


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by flashattn.

    Torch's layout and semantics: query (..., Hq, L, E), key (..., H, S, E),
    value (..., H, S, Ev), leading dims broadcast; returns (..., Hq, L, Ev)
    in query's dtype. ``is_causal`` aligns top-left (query i sees keys
    j <= i, also when L != S); ``attn_mask`` is bool (True: takes part) or
    float (added), broadcastable to (..., Hq, L, S), and may not be given
    with ``is_causal``; ``scale`` defaults to 1/sqrt(E); Hq != H needs
    ``enable_gqa=True`` (H = 1 broadcasts, as in torch). A row that sees no
    key gives 0, as torch's CPU kernels do. ``dropout_p`` must be 0: dropout
    is not implemented (NotImplementedError). A float mask is used as
    float32; one that requires grad is refused.
    """
    fn = "flashattn.torch.scaled_dot_product_attention"
    if dropout_p != 0.0:
        raise NotImplementedError(f"{fn}: dropout (dropout_p={dropout_p!r}) is not implemented; "
                                  f"pass dropout_p=0.0 (e.g. dropout_p if self.training else "
                                  f"0.0, or apply dropout elsewhere)")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 3:
            raise ValueError(f"{fn}: {name} must have at least 3 dimensions (..., heads, T, "
                             f"E), got shape {tuple(x.shape)}")
    is_causal = _args.flag(fn, "is_causal", is_causal)
    if attn_mask is not None and is_causal:
        raise ValueError(f"{fn}: attn_mask and is_causal=True were both given; torch's contract "
                         f"takes one of them (put the causal mask into attn_mask)")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(f"{fn}: attn_mask must be a torch.Tensor or None, got "
                        f"{type(attn_mask).__name__}")
    Hq, L, E = query.shape[-3:]
    H, S = key.shape[-3], key.shape[-2]
    Ev = value.shape[-1]
    if H != Hq and H != 1 and not (enable_gqa and H and Hq % H == 0):
        raise ValueError(f"{fn}: query has {Hq} heads and key {H}: use enable_gqa=True "
                         f"(Hq a multiple of H) or as many heads")
    batch = tuple(torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3]))
    n = int(np.prod(batch, dtype=np.int64))
    q, k, v = (_flat_batch(x, batch).expand(n, -1, -1, -1) for x in (query, key, value))
    scale = 1.0 / E ** 0.5 if scale is None else scale
    if Ev != E:  # flashattn needs one head size: zero columns change no score and no output
        D = max(E, Ev)
        q, k = (torch.nn.functional.pad(x, (0, D - E)) for x in (q, k))
        v = torch.nn.functional.pad(v, (0, D - Ev))
    mask, window = None, (-1, -1)
    if is_causal:
        keys, window = _wrappers.top_left_band(L, S, None, 0)
        k, v = k[:, :, :keys], v[:, :, :keys]
    if attn_mask is not None:
        if attn_mask.dim() < 2:
            raise ValueError(f"{fn}: attn_mask must have at least 2 dimensions (L, S), got "
                             f"shape {tuple(attn_mask.shape)}")
        if attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()  # torch's is in query's dtype; flashattn's float32
        mask = _flat_batch(attn_mask.reshape((1,) * max(0, 3 - attn_mask.dim())
                                             + tuple(attn_mask.shape)), batch)
    o = attention(q, k, v, window=window, scale=float(scale), mask=mask, layout="bhtd")
    o = o.reshape(*batch, Hq, L, o.shape[-1])
    return o[..., :Ev] if Ev != E else o
