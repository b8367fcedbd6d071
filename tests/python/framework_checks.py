"""What the wrapper tests (test_torch, test_jax, test_mlx) share: the inputs,
the option sets, plain attention written once in any framework's array
functions (the framework's own math), and the accuracy rule.

Every check computes the truth with the framework's own math in float64 from
the inputs (rounded to the test's dtype, so the truth is exact for them),
and a yardstick with the same math in float32 from the same inputs, its
result rounded to the dtype. FlashAttention's rule then holds the wrapper to

    max|ours - truth| <= factor * max(max|yardstick - truth|, 1e-6 * magnitude)
                         + ulp(dtype) / 2 * magnitude

with factor 2 for the output (and lse), 3 for gradients, and magnitude the
largest |truth| (for gradients, of dq, dk, dv together: one can be exactly 0).

The backward reads o in the dtype, so its rounding reaches the gradients
through delta = rowsum(do * o) (README); the yardstick's gradients read the
same rounded o: they are the vjp of (o, lse) with cotangents (do, c), where
c = rowsum(do * (o - o rounded)) moves the softmax's delta from o to the
rounded o (d lse / d s = P, so dS = P (dP - delta + c)).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

import flashattn as fa

FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0
FLOOR = 1e-6

DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
          "bf16": np.dtype(ml_dtypes.bfloat16)}

# Worst ratio of each wrapper's error to its yardstick's, and worst |ours -
# theirs| of each drop-in against its framework's function, printed at the end
# of the session (conftest.py) for the report.
WORST_DROP_IN: dict = {}


@dataclasses.dataclass(frozen=True)
class Problem:
    B: int
    Tq: int
    Tk: int
    H: int
    Hkv: int
    D: int


# Awkward sizes; Tq > Tk with causal gives rows that see no key.
SMALL = Problem(2, 13, 29, 4, 2, 20)
TALL = Problem(2, 29, 13, 6, 1, 8)

OPTION_SETS = ["plain", "causal-tall", "window-scale", "softcap-alibi-sinks", "bool-mask-causal",
               "float-mask-alibi-sinks", "everything"]


def make(option_set: str, dtype: str, seed: int = 0):
    """(problem, {q, k, v, do}, options): the arrays float32 holding values
    of ``dtype`` exactly (rounded to it), the options with NumPy arrays
    (score arrays float32 or bool)."""
    problem = TALL if option_set == "causal-tall" else SMALL
    B, Tq, Tk, H, Hkv, D = dataclasses.astuple(problem)
    rng = np.random.default_rng(seed)
    shapes = dict(q=(B, Tq, H, D), k=(B, Tk, Hkv, D), v=(B, Tk, Hkv, D), do=(B, Tq, H, D))
    arrays = {n: rng.standard_normal(s, dtype=np.float32).astype(DTYPES[dtype]).astype(np.float32)
              for n, s in shapes.items()}
    slopes_bh = rng.uniform(0.05, 0.5, (B, H)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    bool_mask = rng.random((1, H, Tq, Tk)) > 0.3
    bool_mask[0, 1, 3] = False  # a row that sees no key
    float_mask = np.where(rng.random((B, 1, 1, Tk)) > 0.2, rng.standard_normal((B, 1, 1, Tk)),
                          -np.inf).astype(np.float32)
    options = {
        "plain": {},
        "causal-tall": dict(causal=True),
        "window-scale": dict(window=(5, 2), scale=0.3),
        "softcap-alibi-sinks": dict(softcap=4.0, alibi_slopes=slopes_bh, sinks=sinks),
        "bool-mask-causal": dict(causal=True, mask=bool_mask),
        "float-mask-alibi-sinks": dict(window=(7, -1), mask=float_mask,
                                       alibi_slopes=slopes_bh[0], sinks=sinks),
        "everything": dict(causal=True, window=(9, 0), scale=0.2, softcap=3.0,
                           alibi_slopes=slopes_bh, mask=float_mask[:1, :, :1] + np.where(
                               rng.random((1, 1, Tq, Tk)) > 0.1, 0, -np.inf).astype(np.float32),
                           sinks=sinks),
    }[option_set]
    return problem, arrays, options


class Ops:
    """The array functions plain_attention needs, from one framework."""

    def __init__(self, *, einsum, where, exp, log, tanh, maximum, repeat, max_last, sum_last,
                 constant):
        self.einsum, self.where, self.exp, self.log, self.tanh = einsum, where, exp, log, tanh
        self.maximum, self.repeat = maximum, repeat
        self.max_last, self.sum_last = max_last, sum_last
        self.constant = constant  # (numpy array, like) -> an array of like's dtype (bool kept)


def plain_attention(ops: Ops, q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
                    alibi_slopes=None, mask=None, sinks=None):
    """o (B, Tq, H, D) and lse (B, H, Tq) of the contract (README), unfused,
    in the inputs' dtype: the score matrix, the options in order (softcap,
    ALiBi, mask, the causal/window band), the softmax with the sink in its
    denominator; a row that sees no key gives o = 0, lse = -inf."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(D) if scale is None else scale
    k, v = ops.repeat(k, H // Hkv, 2), ops.repeat(v, H // Hkv, 2)
    s = ops.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap:
        s = softcap * ops.tanh(s / softcap)
    if alibi_slopes is not None:
        distance = np.abs(np.arange(Tq)[:, None] + Tk - Tq - np.arange(Tk)[None, :])
        slopes = alibi_slopes.reshape(-1, H, 1, 1)
        s = s - slopes * ops.constant(distance, s)
    if mask is not None:
        s = ops.where(mask, s, -np.inf) if mask.dtype in (bool, np.bool_) or "bool" in str(
            mask.dtype) else s + mask
    visible = fa.reference.visible_keys(Tq, Tk, causal=causal, window=window)
    s = ops.where(ops.constant(visible, True), s, -np.inf)
    m = ops.max_last(s)
    if sinks is not None:
        m = ops.maximum(m, sinks.reshape(1, H, 1, 1))
    m = ops.where(m == -np.inf, 0.0, m)
    e = ops.exp(s - m)
    denominator = ops.sum_last(e)
    if sinks is not None:
        denominator = denominator + ops.exp(sinks.reshape(1, H, 1, 1) - m)
    safe = ops.where(denominator == 0, 1.0, denominator)
    lse = ops.where(denominator == 0, -np.inf, m + ops.log(safe))
    return ops.einsum("bhqk,bkhd->bqhd", e / safe, v), lse[..., 0]


def assert_within_rule(name: str, ours, yardstick, truth, *, dtype: str, factor: float,
                       magnitude: float | None = None, out_dtype: str | None = None) -> float:
    """The rule of the module docstring, on NumPy arrays (any float dtype);
    ``yardstick`` is rounded to ``out_dtype`` (default ``dtype``) here.
    -inf (lse of a row that sees no key) must be where the truth has it.
    Returns the ratio error / allowed base."""
    out = DTYPES[out_dtype or dtype]
    truth = np.asarray(truth, np.float64)
    ours = np.asarray(ours, np.float64)
    yardstick = np.asarray(yardstick, np.float32).astype(out).astype(np.float64)
    assert ours.shape == truth.shape, f"{name}: shape {ours.shape}, want {truth.shape}"
    neginf = np.isneginf(truth)
    assert (np.isneginf(ours) == neginf).all(), f"{name}: -inf at the wrong places"
    finite = ~neginf
    assert np.isfinite(ours[finite]).all(), f"{name}: non-finite values where the truth is finite"
    err = float(np.abs(ours[finite] - truth[finite]).max(initial=0))
    base = float(np.abs(yardstick[finite] - truth[finite]).max(initial=0))
    if magnitude is None:
        magnitude = float(np.abs(truth[finite]).max(initial=0))
    allowed = max(base, FLOOR * magnitude)
    rounding = float(ml_dtypes.finfo(out).eps) / 2 * magnitude
    assert err <= factor * allowed + rounding, (
        f"{name} ({dtype}): error {err:.3e} > {factor} x {allowed:.3e} + {rounding:.3e} "
        f"(the framework's float32 math, rounded to {out}: {base:.3e})")
    return err / allowed if allowed else 0.0


def record_drop_in(name: str, dtype: str, ours, theirs) -> float:
    """Records max |ours - theirs| (and relative to max |theirs|) of a drop-in."""
    ours, theirs = (np.asarray(x, np.float64) for x in (ours, theirs))
    finite = np.isfinite(theirs)
    diff = float(np.abs(ours[finite] - theirs[finite]).max(initial=0))
    scale = float(np.abs(theirs[finite]).max(initial=0)) or 1.0
    key = (name, dtype)
    old = WORST_DROP_IN.get(key, (0.0, 0.0))
    WORST_DROP_IN[key] = (max(old[0], diff), max(old[1], diff / scale))
    return diff


def sequences(cu: np.ndarray):
    """The (start, stop) row ranges of the prefix sums ``cu``."""
    return [(int(cu[b]), int(cu[b + 1])) for b in range(len(cu) - 1)]


VARLEN_CU_Q = np.array([0, 7, 7, 20, 31], np.int32)  # an empty sequence, awkward lengths
VARLEN_CU_K = np.array([0, 12, 15, 15, 40], np.int32)  # and one with no keys


def make_varlen(dtype: str, seed: int = 0):
    """Packed q, k, v, do (float32 holding ``dtype``'s values) and options for
    VARLEN_CU_*: causal, softcap, per-sequence ALiBi slopes and sinks."""
    rng = np.random.default_rng(seed)
    H, Hkv, D = 4, 2, 12
    total_q, total_k = int(VARLEN_CU_Q[-1]), int(VARLEN_CU_K[-1])
    shapes = dict(q=(total_q, H, D), k=(total_k, Hkv, D), v=(total_k, Hkv, D),
                  do=(total_q, H, D))
    arrays = {n: rng.standard_normal(s, dtype=np.float32).astype(DTYPES[dtype]).astype(np.float32)
              for n, s in shapes.items()}
    options = dict(causal=True, softcap=5.0,
                   alibi_slopes=rng.uniform(0.05, 0.3, (len(VARLEN_CU_Q) - 1, H)).astype(
                       np.float32),
                   sinks=rng.standard_normal(H).astype(np.float32))
    return arrays, options


def plain_varlen(ops: Ops, concatenate, q, k, v, cu_q, cu_k, *, alibi_slopes=None, **options):
    """plain_attention over each sequence of packed arrays; o (total_q, H, D)
    and lse (H, total_q)."""
    outs, lses = [], []
    H, D = q.shape[1], q.shape[2]
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(sequences(cu_q), sequences(cu_k))):
        slopes = None if alibi_slopes is None else alibi_slopes[b]
        if q0 == q1:  # no rows (MLX 0.32.4 dies of SIGFPE differentiating them in float64)
            outs.append(ops.constant(np.zeros((0, H, D)), q))
            lses.append(ops.constant(np.zeros((H, 0)), q))
            continue
        if k0 == k1:  # no keys: o = 0, lse = the sink (or -inf)
            outs.append(ops.constant(np.zeros((q1 - q0, H, D)), q))
            sinks = options.get("sinks")
            if sinks is None:
                lses.append(ops.constant(np.full((H, q1 - q0), -np.inf), q))
            else:
                lses.append(sinks.reshape(H, 1) + ops.constant(np.zeros((H, q1 - q0)), q))
            continue
        o, lse = plain_attention(ops, q[q0:q1][None], k[k0:k1][None], v[k0:k1][None],
                                 alibi_slopes=slopes, **options)
        outs.append(o[0])
        lses.append(lse[0])
    return concatenate(outs, 0), concatenate(lses, 1)
