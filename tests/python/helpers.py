"""Shared test machinery: the case type, the per-engine size policy, input
generation, and FlashAttention's tolerance rule against the float64 reference
(with a record of the worst error ratio, printed at the end of the session).

The tolerance rule (FlashAttention's tests/test_flash_attn.py): an engine's
max |error| against the float64 reference may be at most FACTOR times the max
|error| of the plain, unfused float32 NumPy implementation of the same math
(``fa.reference.*(..., dtype=np.float32)``) against the same reference:
FACTOR = 2 for the forward (o, lse), 3 for gradients (whose plain
implementation takes delta = rowsum(do * o) from the o handed in, as the
engines do). To avoid 0-vs-0 ratios
(e.g. Tk = 1, where float32 is exact), the baseline error is raised to a floor
of 1e-6 x the magnitude of the values (max |reference| of that array; for
gradients, the largest of dq, dk, dv, since dq is exactly zero in exact
arithmetic when a row sees a single key):

    max|engine - ref64| <= FACTOR * max(max|numpy32 - ref64|, 1e-6 * magnitude)
                           + ulp(dtype) / 2 * magnitude

In float16 and bfloat16 (issue 15) the same rule holds in the input
precision: the inputs are the half arrays (the float64 reference reads them
exactly), the yardstick numpy32 computes in float32 from them and rounds its
result to the dtype, and the last term is half an ulp of the output's dtype
(float32's for lse, which is float32 always) at the output's magnitude.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict

import ml_dtypes
import numpy as np

import flashattn as fa

FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0
FLOOR = 1e-6

# Engines that simulate GPU kernels on the CPU: correct but slow, so they run
# the cases whose work fits a budget (multiply-adds of q.k^T for the whole
# call); every other engine runs every case. tests/run.sh's fast run lowers
# the budget through FLASHATTN_TEST_SIM_BUDGET (the deselected cases are
# counted in pytest's summary); CI (run.sh --all) keeps this one: every head
# size of the grid up to 128 at its largest sizes (B = 2, 6 heads, 113 x 203:
# 35M), the larger head sizes (hd256's bucket) at the smaller sizes (and in
# the C++ sim tests at 100 x 100 and 129 x 65); not the 1023 x 1024 cases.
# At 150M those cases took 17 minutes of CI's 2-core pytest, in 3 dtypes.
SIMULATED = {"metal-sim"}
SIM_BUDGET = int(os.environ.get("FLASHATTN_TEST_SIM_BUDGET", 36_000_000))
# The same for the 16-bit dtypes on every engine: tests/run.sh's fast run
# runs float16 and bfloat16 on the cases within FLASHATTN_TEST_HALF_BUDGET
# (the larger ones in float32 only); unset, every case in every dtype.
HALF_BUDGET = int(os.environ.get("FLASHATTN_TEST_HALF_BUDGET", 2**62))

# The dtypes of q, k, v (a test that takes `dtype` runs in each, on every
# engine that takes it: conftest.py), by the id pytest shows.
DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
          "bf16": np.dtype(ml_dtypes.bfloat16)}


def dtype_id(dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == np.dtype(dtype))


def half_ulp(dtype) -> float:
    """Half the spacing of dtype's numbers at 1 (its unit roundoff)."""
    return float(ml_dtypes.finfo(dtype).eps) / 2


# Worst ratio seen, error / max(baseline error, floor), per (backend, dtype,
# output, factor the test allowed): printed at the end of the session by conftest.
WORST: dict = defaultdict(float)


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    Tq: int
    Tk: int
    H: int
    Hkv: int
    D: int
    causal: bool = False
    window: tuple = (-1, -1)

    @property
    def work(self) -> int:
        return self.B * self.H * self.Tq * self.Tk * self.D

    @property
    def id(self) -> str:
        heads = "mha" if self.H == self.Hkv else ("mqa" if self.Hkv == 1 else "gqa")
        mask = ("causal" if self.causal else "full") + (
            "" if self.window == (-1, -1) else f"-w{self.window[0]}_{self.window[1]}"
        )
        return f"B{self.B}-{self.Tq}x{self.Tk}-{heads}{self.H}_{self.Hkv}-d{self.D}-{mask}"

    def opts(self) -> dict:
        return dict(causal=self.causal, window=self.window)


def fits(backend: str, case: Case, dtype=np.float32) -> bool:
    """The size policy: simulated engines get the cases within their budget,
    16-bit dtypes the cases within theirs."""
    if np.dtype(dtype).itemsize == 2 and case.work > HALF_BUDGET:
        return False
    return backend not in SIMULATED or case.work <= SIM_BUDGET


def inputs(case: Case, seed: int = 0, dtype=np.float32):
    """q, k, v, do: standard normal float32, seeded, rounded to ``dtype``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.B, case.Tq, case.H, case.D), dtype=np.float32)
    k = rng.standard_normal((case.B, case.Tk, case.Hkv, case.D), dtype=np.float32)
    v = rng.standard_normal((case.B, case.Tk, case.Hkv, case.D), dtype=np.float32)
    do = rng.standard_normal((case.B, case.Tq, case.H, case.D), dtype=np.float32)
    return tuple(x.astype(dtype) for x in (q, k, v, do))


def _max_abs(x) -> float:
    return float(np.max(np.abs(x))) if np.size(x) else 0.0


def assert_close_to_reference(got, ref64, base32, *, factor: float, backend: str, name: str,
                              magnitude: float | None = None, dtype=np.float32, out_dtype=None):
    """FlashAttention's rule (see the module docstring). ``dtype`` is the
    inputs'; ``got`` is the engine's output, which must be of ``out_dtype``
    (default ``dtype``; lse is float32 always), ``ref64`` the float64
    reference, ``base32`` the plain float32 implementation's output (rounded
    to ``out_dtype`` here). Entries where the reference is
    -inf (lse of a row that sees no key) must be -inf in ``got`` too and are
    left out of the error. ``magnitude`` (default max |ref64|) sets the floor:
    gradients pass the largest of the three, since one of them can be exactly
    zero in exact arithmetic (dq with a single visible key) while the engine
    and NumPy round differently."""
    got = np.asarray(got)
    dtype = np.dtype(dtype)
    out_dtype = dtype if out_dtype is None else np.dtype(out_dtype)
    ref64 = np.asarray(ref64, dtype=np.float64)
    base32 = np.asarray(base32, dtype=np.float32).astype(out_dtype).astype(np.float64)
    assert got.dtype == out_dtype, f"{name}: dtype {got.dtype}, want {out_dtype}"
    got = got.astype(np.float64)
    assert got.shape == ref64.shape, f"{name}: shape {got.shape}, want {ref64.shape}"
    assert np.isfinite(ref64[~np.isneginf(ref64)]).all(), f"{name}: the reference is not finite"
    neginf = np.isneginf(ref64)
    wrong_inf = np.flatnonzero(np.isneginf(got) != neginf)
    assert wrong_inf.size == 0, (
        f"{name} ({backend}): -inf at the wrong places, first at flat index {wrong_inf[0]}: "
        f"got {got.flat[wrong_inf[0]]}, want {ref64.flat[wrong_inf[0]]}"
    )
    finite = ~neginf
    bad = np.flatnonzero(~np.isfinite(got[finite]))
    assert bad.size == 0, f"{name} ({backend}): {bad.size} non-finite values where the reference is finite"
    err = _max_abs(got[finite] - ref64[finite])
    base = _max_abs(base32[finite] - ref64[finite])
    if magnitude is None:
        magnitude = _max_abs(ref64[finite])
    allowed_base = max(base, FLOOR * magnitude)
    rounding = half_ulp(out_dtype) * magnitude  # the output's own rounding, once
    ratio = err / allowed_base if allowed_base > 0 else (0.0 if err == 0 else float("inf"))
    key = (backend, dtype_id(dtype), name, factor)
    WORST[key] = max(WORST[key], ratio)
    assert err <= factor * allowed_base + rounding, (
        f"{name} ({backend}, {dtype} inputs): max error {err:.3e} > {factor} x {allowed_base:.3e} "
        f"+ {rounding:.3e} (float32 numpy error, rounded to {out_dtype}: {base:.3e}); "
        f"ratio {ratio:.2f}"
    )


def check_forward(backend: str, case: Case, q, k, v, *, scale=None):
    """Runs the engine's forward on (q, k, v) and checks o and lse by the
    rule, in q's dtype."""
    opts = dict(case.opts(), scale=scale)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **opts)
    o64, lse64 = fa.reference.attention(q, k, v, return_lse=True, **opts)
    o32, lse32 = fa.reference.attention(q, k, v, return_lse=True, dtype=np.float32, **opts)
    assert isinstance(o, np.ndarray) and isinstance(lse, np.ndarray)
    assert o.flags.c_contiguous and lse.flags.c_contiguous
    assert lse.shape == (case.B, case.H, case.Tq)
    assert_close_to_reference(o, o64, o32, factor=FORWARD_FACTOR, backend=backend, name="o",
                              dtype=q.dtype)
    assert_close_to_reference(lse, lse64, lse32, factor=FORWARD_FACTOR, backend=backend, name="lse",
                              dtype=q.dtype, out_dtype=np.float32)
    return o, lse


def check_backward(backend: str, case: Case, q, k, v, do, *, scale=None):
    """Runs forward then backward on the engine; checks dq, dk, dv by the
    rule, in q's dtype (o, the engine's, is of that dtype too)."""
    opts = dict(case.opts(), scale=scale)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **opts)
    grads = fa.attention_backward(do, q, k, v, o, lse, backend=backend, **opts)
    refs = fa.reference.attention_backward(do, q, k, v, **opts)
    # The yardstick reads what the engine reads: delta from the o handed in
    # (the engine's, in q's dtype: float16 and bfloat16 round it).
    bases = fa.reference.attention_backward(do, q, k, v, o, lse, dtype=np.float32,
                                            delta_from_o=True, **opts)
    assert len(grads) == 3
    magnitude = max(_max_abs(r) for r in refs)
    for name, got, ref, base, like in zip(("dq", "dk", "dv"), grads, refs, bases, (q, k, v)):
        assert got.shape == like.shape, f"{name}: shape {got.shape}, want {like.shape}"
        assert got.flags.c_contiguous
        assert_close_to_reference(got, ref, base, factor=GRADIENT_FACTOR, backend=backend, name=name,
                                  magnitude=magnitude, dtype=q.dtype)
    return grads


# ---------------------------------------------------------------- the grid
# One parametrised grid, used by the forward and the backward tests.
HEADS = [(4, 4), (6, 2), (4, 1)]  # MHA, GQA, MQA
MASKS = [
    (False, (-1, -1)),  # full
    (True, (-1, -1)),   # causal (bottom-right)
    (True, (15, 0)),    # the seed's window w = 16: (w - 1, 0) with causal
    (True, (7, 3)),     # causal caps a bounded right side at 0
    (False, (17, 9)),   # both sides bounded
    (False, (-1, 5)),   # right side only
    (False, (8, -1)),   # left side only
]
# (Tq, Tk): T = 1, decode (Tq = 1), Tq < Tk and Tq > Tk (causal: the first
# Tq - Tk rows see no key), awkward sizes; the small ones are what the
# simulated engines run.
SIZES = [(1, 1), (1, 37), (1, 203), (13, 29), (29, 13), (64, 64), (113, 203), (203, 113)]
HEAD_DIMS = [1, 59, 64, 111, 256]
# More head sizes, each inside a bucket of the metal kernels (8 in hd32, 72
# and 80 in hd96, 160, 192 and 200 in hd256).
MORE_HEAD_DIMS = [8, 72, 80, 160, 192, 200]
# Decode: Tq in {1, 4} against key caches up to 4096, GQA groups 1, 4 and 8
# (the metal kernels pack a group's query heads into one threadgroup and
# split long key ranges across threadgroups, merging them exactly).
DECODE = [(Tq, Tk, H, Hkv) for Tq in (1, 4) for Tk in (37, 1000, 4096)
          for H, Hkv in ((4, 4), (8, 2), (16, 2))]

GRID = sorted(
    {Case(2, Tq, Tk, H, Hkv, 64, causal, window)
     for H, Hkv in HEADS for causal, window in MASKS for Tq, Tk in SIZES}
    | {Case(2, Tq, Tk, 6, 2, D, causal, window)
       for D in HEAD_DIMS
       for causal, window in [MASKS[0], MASKS[1], MASKS[4]]
       for Tq, Tk in [(1, 203), (13, 29), (29, 13), (113, 203), (203, 113)]}
    | {Case(2, Tq, Tk, 6, 2, D, causal, window)
       for D in MORE_HEAD_DIMS
       for causal, window in [MASKS[0], MASKS[1]]
       for Tq, Tk in [(13, 29), (113, 203)]}
    | {Case(1, Tq, Tk, H, Hkv, 64, causal, window)
       for Tq, Tk, H, Hkv in DECODE
       for causal, window in [MASKS[0], (True, (255, 0))]}
    | {Case(1, 1023, 1024, 2, 1, 64, causal, window)  # the big one: fast engines only
       for causal, window in [MASKS[0], MASKS[1], (True, (255, 0))]},
    key=lambda c: c.id,
)
