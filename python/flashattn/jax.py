"""flashattn for JAX: differentiable attention under jax.jit, jax.grad, jax.vmap.

    import flashattn.jax as faj
    o = faj.attention(q, k, v, causal=True)    # q (B, Tq, H, D); k, v (B, Tk, Hkv, D)

The forward and the fused backward are XLA FFI custom calls (``jax.ffi``)
into C++ handlers of flashattn's extension (cpp/bindings/xla_handlers.cpp),
run by XLA's CPU runtime on the cpu engine: no Python and no callback in the
jitted program. ``jax.custom_vjp`` saves o and the log-sum-exp and calls the
fused backward. XLA hands the handlers its own buffers: nothing is copied.
float32 only; the arrays must be on the CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _core
from ._args import scale as _scale, window as _window

__all__ = ["attention"]

_FORWARD = "flashattn_attention_fwd"
_BACKWARD = "flashattn_attention_bwd"


def _register() -> None:
    jax.ffi.register_ffi_target(_FORWARD, _core._xla_forward(), platform="cpu")
    jax.ffi.register_ffi_target(_BACKWARD, _core._xla_backward(), platform="cpu")


_register()


def _check(q, k, v) -> None:
    fn = "flashattn.jax.attention"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{fn}: {name} must be a JAX array, got {type(x).__name__}")
        if x.dtype != jnp.float32:
            raise TypeError(
                f"{fn}: {name} must be float32, got {x.dtype}; convert with "
                f"{name}.astype(jnp.float32)"
            )
        if x.ndim != 4:
            raise ValueError(
                f"{fn}: {name} must have 4 dimensions (B, T, heads, D), got shape {x.shape}"
            )
    # Every other shape rule (heads, D range, matching k and v) is checked by
    # the core when the call runs; these catch the common mistakes at trace time.
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have the same shape, got {k.shape} and {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{fn}: q {q.shape} and k {k.shape} must share B and D, and q's heads must be "
            f"a multiple of k's"
        )


def _attrs(causal, left, right, scale):
    return dict(causal=bool(causal), window_left=np.int64(left), window_right=np.int64(right),
                scale=np.float64(scale))


def _forward_call(q, k, v, attrs):
    B, Tq, H, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
           jax.ShapeDtypeStruct((B, H, Tq), jnp.float32))
    # broadcast_all: under vmap the handler sees the mapped axes as leading
    # axes of every operand and folds them into B.
    return jax.ffi.ffi_call(_FORWARD, out, vmap_method="broadcast_all")(q, k, v, **attrs)


def _backward_call(do, q, k, v, o, lse, attrs):
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
           jax.ShapeDtypeStruct(k.shape, jnp.float32),
           jax.ShapeDtypeStruct(v.shape, jnp.float32))
    return jax.ffi.ffi_call(_BACKWARD, out, vmap_method="broadcast_all")(
        do, q, k, v, o, lse, **attrs)


def _make(attrs):
    @jax.custom_vjp
    def attend(q, k, v):
        return _forward_call(q, k, v, attrs)[0]

    def attend_fwd(q, k, v):
        o, lse = _forward_call(q, k, v, attrs)
        return o, (q, k, v, o, lse)

    def attend_bwd(res, do):
        q, k, v, o, lse = res
        return _backward_call(do.astype(jnp.float32), q, k, v, o, lse, attrs)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


_FUNCTIONS: dict = {}


def attention(q, k, v, *, causal=False, window=(-1, -1), scale=None):
    """Exact softmax attention, fused, differentiable (the fused backward).

    Same contract as ``flashattn.attention``: q (B, Tq, H, D), k and v
    (B, Tk, Hkv, D), float32 JAX arrays on the CPU; returns o shaped like q.
    Works under ``jax.jit``, ``jax.grad`` and ``jax.vmap``.
    """
    fn = "flashattn.jax.attention"
    _check(q, k, v)
    left, right = _window(fn, window)
    scale = _scale(fn, scale)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    attrs = _attrs(causal, left, right, scale)
    key = tuple(sorted((name, float(value)) for name, value in attrs.items()))
    if key not in _FUNCTIONS:
        _FUNCTIONS[key] = _make(attrs)
    return _FUNCTIONS[key](q, k, v)
