"""Accuracy at large score spreads (issue 32 item 8): the standard deviation
of the scores scale * q.k swept from 1 to 100 (|s| up to a few hundred),
o, lse, dq, dk and dv against the float64 reference, next to plain float32
NumPy (fa.reference with dtype=float32) and, where torch is installed,
torch's scaled_dot_product_attention in float32 on the same inputs.

At a large spread the error of o comes from the scores' own rounding: a
score error reaches o through exp, in the few rows whose top scores nearly
tie. How a score is summed over d then decides o's error: one FMA chain
over all of D (the cpu engine before issue 32, the metal kernels' 8-term
fragment products) gave 1.9-2.4x NumPy's root mean square error from a
spread of 3 (and a largest o error up to 6x NumPy's), NumPy's einsum
adding each SIMD lane's terms apart and then the lanes. Two checks:

- the error's root mean square over all entries of the sweep, against
  NumPy's (for gradients: the plain float32 backward that reads the float32
  lse, as every FlashAttention backward does): a statistic of many rows, which tells one summation order from another
  (the largest error sits in a single near-tie row and moves by 2x from one
  seed to the next even between equally good orders);
- the README's rule on the largest error, whose baseline at these spreads
  is the larger of NumPy's and torch SDPA's float32 errors (torch's own
  largest error is up to 4.6x NumPy's here: docs/semantics.md).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import flashattn as fa
from helpers import FLOOR, FORWARD_FACTOR, GRADIENT_FACTOR, SIM_BUDGET, SIMULATED

SPREADS = [1, 3, 10, 30, 100]
# (B, Tq, Tk, H, Hkv, D, causal): plain, GQA with a causal edge, decoding
# against a longer cache, D from 16 to 256 (odd D = 40, 72 included).
SHAPES = [(1, 128, 128, 2, 2, 16, False), (1, 96, 96, 4, 2, 40, True),
          (1, 128, 128, 2, 2, 64, False), (1, 8, 300, 4, 1, 72, False),
          (1, 128, 128, 2, 1, 128, True), (1, 80, 80, 2, 2, 256, False),
          (3, 50, 70, 2, 2, 64, True)]  # B = 3: packed, through the varlen entry points
SEEDS = (0, 1)
# Bounds by engine: the root mean square error over the plain float32
# implementation's (every output), and the largest error over the larger of
# NumPy's and torch SDPA's for o and lse, and for the gradients. The cpu
# engine sums each score in chunks of d (cpu/gemm.h d_chunk) and keeps the
# README's 2x / 3x. The metal kernels (metal-sim runs them; metal is the
# same source) still add one 8-term fragment product at a time to a score:
# measured on metal-sim, root mean square 1.5x (spread 1) to 2.5x (spreads
# 10-100) and o's largest error 2.5x the larger baseline (spread 10), so
# their bounds are wider (docs/semantics.md).
BOUNDS = {"cpu": dict(rms=1.5, forward=FORWARD_FACTOR, gradient=GRADIENT_FACTOR),
          "metal-sim": dict(rms=3.0, forward=4.0, gradient=GRADIENT_FACTOR)}
BOUNDS["metal"] = BOUNDS["metal-sim"]


def _inputs(shape, sigma, seed):
    B, Tq, Tk, H, Hkv, D, causal = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Tq, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Tk, Hkv, D)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal((B, Tq, H, D)).astype(np.float32)
    return q, k, v, do, dict(scale=sigma / np.sqrt(D), causal=causal)


def _plain_backward_reading_lse(do, q, k, v, o32, lse32, opts):
    """The plain float32 backward as FlashAttention's reads its forward:
    P = exp(scale q.k - lse) from the float32 lse, delta = rowsum(do o).
    At a large spread lse (hundreds) carries its own rounding, u |lse|,
    into every P of its row; the plain backward that takes its softmax
    afresh (fa.reference) does not pay it, and the gradients' root mean
    square error of every FlashAttention-style backward is then 3-5x
    its own (torch SDPA's largest dv error is 7x NumPy's there)."""
    f32 = np.float32
    rep = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    scale = f32(opts["scale"])
    s = np.einsum("bqhd,bkhd->bhqk", q * scale, kr)
    if opts["causal"]:
        Tq, Tk = q.shape[1], k.shape[1]
        s = np.where(np.tril(np.ones((Tq, Tk), bool), Tk - Tq), s, f32(-np.inf))
    p = np.exp(s - lse32[..., None])
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
    ds = p * (dp - np.einsum("bqhd,bqhd->bhq", do, o32)[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    B, Tk, Hkv, D = k.shape
    return (dq, dk.reshape(B, Tk, Hkv, rep, D).sum(axis=3),
            dv.reshape(B, Tk, Hkv, rep, D).sum(axis=3))


def _outputs(backend, q, k, v, do, opts):
    """The engine's o, lse, dq, dk, dv; a batch of B > 1 goes through the
    varlen entry points, its sequences packed."""
    if q.shape[0] == 1:
        o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **opts)
        return (o, lse, *fa.attention_backward(do, q, k, v, o, lse, backend=backend, **opts))
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    cq = np.arange(B + 1, dtype=np.int32) * Tq
    ck = np.arange(B + 1, dtype=np.int32) * Tk
    pq, pk, pv, pdo = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v, do))
    o, lse = fa.attention_varlen(pq, pk, pv, cq, ck, return_lse=True, backend=backend, **opts)
    g = fa.attention_varlen_backward(pdo, pq, pk, pv, o, lse, cq, ck, backend=backend, **opts)
    return (o.reshape(q.shape), lse.reshape(H, B, Tq).transpose(1, 0, 2),
            *(x.reshape(y.shape) for x, y in zip(g, (q, k, v))))


def _errors(backend, shape, sigma, seed):
    """{name: (engine, numpy32, torch32 or None, numpy32 reading lse)}
    errors against float64, as (max |error|, sum of squared errors,
    magnitude) each."""
    q, k, v, do, opts = _inputs(shape, sigma, seed)
    with np.errstate(all="ignore"):
        o64, lse64 = fa.reference.attention(q, k, v, return_lse=True, **opts)
        g64 = fa.reference.attention_backward(do, q, k, v, **opts)
        o32, lse32 = fa.reference.attention(q, k, v, return_lse=True, dtype=np.float32, **opts)
        g32 = fa.reference.attention_backward(do, q, k, v, o32, dtype=np.float32,
                                              delta_from_o=True, **opts)
        g32_lse = _plain_backward_reading_lse(do, q, k, v, o32, lse32, opts)
    theirs = _torch_sdpa(q, k, v, do, opts)
    refs = dict(zip(("o", "lse", "dq", "dk", "dv"), (o64, lse64, *g64)))
    ours = dict(zip(refs, _outputs(backend, q, k, v, do, opts)))
    plain = dict(zip(refs, (o32, lse32, *g32)))
    plain_lse = dict(zip(refs, (o32, lse32, *g32_lse)))
    grad_magnitude = max(float(np.max(np.abs(x))) for x in g64)
    out = {}
    for name, ref in refs.items():
        mag = grad_magnitude if name.startswith("d") else float(np.max(np.abs(ref)))

        def err(x):
            if x is None:
                return None
            e = np.asarray(x, np.float64) - ref
            return float(np.max(np.abs(e))), float(np.sum(e * e)), mag
        out[name] = (err(ours[name]), err(plain[name]), err(theirs.get(name)),
                     err(plain_lse[name]))
    return out


def _torch_sdpa(q, k, v, do, opts):
    """torch SDPA float32 (its cpu kernel) on the same inputs, or {}."""
    try:
        import torch
    except ImportError:
        return {}
    F = torch.nn.functional
    rep = q.shape[2] // k.shape[2]
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    causal = opts["causal"]
    mask = None
    if causal:  # bottom-right aligned, as the engines
        Tq, Tk = q.shape[1], k.shape[1]
        mask = torch.from_numpy(np.tril(np.ones((Tq, Tk), bool), Tk - Tq))
    ot = F.scaled_dot_product_attention(tq, tk.repeat_interleave(rep, 1),
                                        tv.repeat_interleave(rep, 1), attn_mask=mask,
                                        scale=float(opts["scale"]))
    ot.backward(torch.from_numpy(do).transpose(1, 2))
    return {name: t.detach().transpose(1, 2).numpy()
            for name, t in zip(("o", "dq", "dk", "dv"), (ot, tq.grad, tk.grad, tv.grad))}


def _skip_past_the_sim_budget(backend):
    """Simulated engines run the sweep when its largest case fits the
    budget (helpers.SIM_BUDGET: CI's; tests/run.sh's fast run lowers it)."""
    work = max(B * Tq * Tk * H * D for B, Tq, Tk, H, _, D, _ in SHAPES)
    if backend in SIMULATED and work > SIM_BUDGET:
        pytest.skip(f"{backend}: the sweep's largest case is {work} multiply-adds, "
                    f"over FLASHATTN_TEST_SIM_BUDGET={SIM_BUDGET}")


@functools.lru_cache(maxsize=None)  # both tests read one sweep
def _sweep(backend, sigma):
    """Over SHAPES and SEEDS at one spread: the engine's root mean square
    error over all their entries, over the plain implementation's (o, lse:
    NumPy's; gradients: NumPy's reading the float32 lse), and the largest
    ratio of the largest errors to the README's baseline, per output."""
    sq, sq_plain, worst_max = {}, {}, {}
    for shape in SHAPES:
        for seed in SEEDS:
            for name, (ours, plain, theirs, plain_lse) in _errors(backend, shape, sigma,
                                                                  seed).items():
                sq[name] = sq.get(name, 0.0) + ours[1]
                sq_plain[name] = sq_plain.get(name, 0.0) + plain_lse[1]
                base = max(plain[0], theirs[0] if theirs else 0.0, FLOOR * ours[2])
                worst_max[name] = max(worst_max.get(name, 0.0), ours[0] / base)
    return {n: float(np.sqrt(sq[n] / sq_plain[n])) if sq_plain[n] else 0.0 for n in sq}, worst_max


@pytest.mark.parametrize("sigma", SPREADS)
def test_error_root_mean_square_at_score_spreads(backend, sigma):
    """The engine's root mean square error is at most BOUNDS' rms times the
    plain float32 implementation's, for every output: before issue 32 the
    cpu engine's o was 1.5x NumPy's at spread 1 and 1.9-2.4x from a spread
    of 3 (one chain of FMAs over all of d for each score), 0.9x after."""
    _skip_past_the_sim_budget(backend)
    bound = BOUNDS[backend]["rms"]
    worst, _ = _sweep(backend, sigma)
    bad = {n: round(r, 2) for n, r in worst.items() if r > bound}
    assert not bad, (f"{backend}, score spread {sigma}: root mean square error over plain "
                     f"float32's above {bound}: {bad} (all: "
                     f"{ {n: round(r, 2) for n, r in worst.items()} })")


@pytest.mark.parametrize("sigma", SPREADS)
def test_max_error_at_score_spreads_against_torch_sdpa(backend, sigma):
    """The README's rule at large spreads: the largest error is at most 2x
    (o, lse) or 3x (gradients) the larger of plain float32 NumPy's and
    torch SDPA float32's on the same inputs (the metal kernels: BOUNDS)."""
    pytest.importorskip("torch", reason="torch is in the torch extra (CI installs it)")
    _skip_past_the_sim_budget(backend)
    _, worst = _sweep(backend, sigma)
    bound = {n: BOUNDS[backend]["forward" if n in ("o", "lse") else "gradient"] for n in worst}
    bad = {n: round(r, 2) for n, r in worst.items() if r > bound[n]}
    assert not bad, (f"{backend}, score spread {sigma}: largest error over the larger of "
                     f"NumPy's and torch SDPA's above {bound}: {bad}")
