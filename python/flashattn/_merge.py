"""fa.merge_states: attention over a union of key sets, from the partial
results over each set (their o and lse). Split-KV decode and ring attention
are built on it; the cpu engine's split-KV merge (cpp/cpu/merge.h) computes
the same formula in C++.

For parts s with (o_s, lse_s): m = max_s lse_s, w_s = exp(lse_s - m),
lse = m + log(sum_s w_s), o = sum_s w_s o_s / sum_s w_s. Subtracting m first
keeps every weight in [0, 1], so no lse magnitude overflows; a row whose
parts all have lse = -inf saw no key: o = 0, lse = -inf.
"""

from __future__ import annotations

import numpy as np

from . import _args, _dtypes

__all__ = ["merge_states"]


def _parts(fn: str, name: str, parts) -> list[np.ndarray]:
    """The parts as arrays: a sequence of arrays, or one array stacked on
    axis 0. A masked array (the sequence or a part) is refused as the NumPy
    API refuses one: its mask would be ignored."""
    if isinstance(parts, np.ma.MaskedArray):
        _args.array(fn, name, parts)
    if isinstance(parts, np.ndarray):
        parts = list(parts)  # an array stacked on axis 0: one part per index
    try:
        parts = list(parts)
    except TypeError:
        raise TypeError(
            f"{fn}: {name} must be a sequence of arrays, got {type(parts).__name__}"
        ) from None
    if not parts:
        raise ValueError(f"{fn}: {name} is empty; give at least one part")
    for i, x in enumerate(parts):
        if isinstance(x, np.ma.MaskedArray):  # np.asarray would drop its mask silently
            _args.array(fn, f"{name}[{i}]", x)
    return [_args.array(fn, f"{name}[{i}]", np.asarray(x)) for i, x in enumerate(parts)]


def merge_states(o_parts, lse_parts):
    """Merge partial attention results over disjoint key sets, exactly.

    Args:
        o_parts: S arrays shaped like ``o``, (B, Tq, H, D), all of one float
            dtype (float32, float16 or bfloat16).
        lse_parts: S float32 arrays shaped like ``lse``, (B, H, Tq), the
            log-sum-exp of each part's scaled scores (``return_lse=True``).

    Returns:
        (o, lse): what attention over the union of the parts' keys gives; o in
        the parts' dtype, lse float32 (B, H, Tq). Stable at any lse
        magnitude; rows where every part has lse = -inf get o = 0 and
        lse = -inf. NaN in a part's lse or o reaches that row's result.
    """
    fn = "merge_states"
    os_, ls = _parts(fn, "o_parts", o_parts), _parts(fn, "lse_parts", lse_parts)
    if len(os_) != len(ls):
        raise ValueError(f"{fn}: {len(os_)} o_parts but {len(ls)} lse_parts; give one lse per o")
    shape, dtype = os_[0].shape, os_[0].dtype
    if len(shape) != 4:
        raise ValueError(f"{fn}: o_parts[0] must be (B, Tq, H, D), got shape {shape}")
    B, Tq, H, _ = shape
    for i, (o, lse) in enumerate(zip(os_, ls)):
        if o.dtype != dtype:
            raise TypeError(f"{fn}: o_parts[{i}] is {o.dtype} but o_parts[0] is {dtype}; "
                            "give every part one dtype")
        if _dtypes.name_of(dtype) is None:  # as the engines: float64 is not cast for you
            raise TypeError(f"{fn}: o_parts[{i}] must be float32, float16 or bfloat16 (the "
                            f"engines' o), got {o.dtype}; convert with .astype(np.float32)")
        if o.shape != shape:
            raise ValueError(f"{fn}: o_parts[{i}] has shape {o.shape}, o_parts[0] {shape}")
        if lse.dtype != np.float32:
            raise TypeError(f"{fn}: lse_parts[{i}] must be float32, got {lse.dtype}")
        if lse.shape != (B, H, Tq):
            raise ValueError(f"{fn}: lse_parts[{i}] must be (B, H, Tq) = {(B, H, Tq)}, "
                             f"got {lse.shape}")

    lse_all = np.stack(ls)  # (S, B, H, Tq): O(S·B·H·T), no D
    m = lse_all.max(axis=0)
    seen = m != -np.inf  # NaN counts as seen: it must reach the result
    m_safe = np.where(seen, m, np.float32(0))  # -inf - -inf never happens
    w = np.exp(lse_all - m_safe)  # in [0, 1]; 0 for an empty part
    total = w.sum(axis=0)
    lse = np.where(seen, m_safe + np.log(np.where(seen, total, 1)), -np.inf).astype(np.float32)
    inv = np.where(seen, 1 / np.where(seen, total, 1), 0).astype(np.float32)

    acc = np.zeros(shape, np.float32)
    for o, ws in zip(os_, w):
        # (B, H, Tq) weights against (B, Tq, H, D) rows. An empty part's o is
        # 0 by contract; its weight 0 must not turn a stray inf into NaN.
        ws = (ws * inv).transpose(0, 2, 1)[..., None]
        acc += np.where(ws > 0, ws * o.astype(np.float32, copy=False), np.float32(0))
    # A NaN lse leaves ws NaN, and the where above would drop it: say so.
    acc[np.isnan(lse).transpose(0, 2, 1)] = np.nan
    return acc.astype(dtype, copy=False), lse
