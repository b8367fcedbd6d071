"""The rule the framework tests share: flashattn's error against the float64
reference may be at most ``factor`` times the error of the framework's own
float32 attention against it (FlashAttention's rule, with the framework in
place of plain NumPy): 2 for the output, 3 for gradients. A floor of 1e-6 x
the largest magnitude keeps exact-vs-exact cases from dividing by zero."""

from __future__ import annotations

import numpy as np

import flashattn as fa

FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0
FLOOR = 1e-6


def errors(ours, theirs, ref64) -> tuple[float, float]:
    ours, theirs = (np.asarray(x, dtype=np.float64) for x in (ours, theirs))
    return float(np.abs(ours - ref64).max()), float(np.abs(theirs - ref64).max())


def assert_as_close_as(name: str, ours, theirs, ref64, *, factor: float) -> None:
    ref64 = np.asarray(ref64, dtype=np.float64)
    err, base = errors(ours, theirs, ref64)
    allowed = max(base, FLOOR * float(np.abs(ref64).max()))
    assert err <= factor * allowed, (
        f"{name}: flashattn error {err:.3e} > {factor} x {allowed:.3e} "
        f"(the framework's own float32 error {base:.3e})"
    )


def reference(q, k, v, do, *, causal=False, window=(-1, -1)):
    """o and (dq, dk, dv) from the float64 reference, in (B, T, H, D)."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    o = fa.reference.attention(q, k, v, causal=causal, window=window)
    grads = fa.reference.attention_backward(do, q, k, v, causal=causal, window=window)
    return o, grads


def inputs(B, Tq, Tk, H, Hkv, D, seed=0):
    rng = np.random.default_rng(seed)
    shape = lambda T, h: (B, T, h, D)  # noqa: E731
    q = rng.standard_normal(shape(Tq, H), dtype=np.float32)
    k = rng.standard_normal(shape(Tk, Hkv), dtype=np.float32)
    v = rng.standard_normal(shape(Tk, Hkv), dtype=np.float32)
    do = rng.standard_normal(shape(Tq, H), dtype=np.float32)
    return q, k, v, do
