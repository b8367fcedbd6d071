"""The score-option cases the in-stream tests (MLX, torch) share."""

from __future__ import annotations

import numpy as np

# One call per option, and all of them at once; each in every dtype.
OPTIONS = {
    "plain": {},
    "causal-window": dict(causal=True, window=(6, 0)),
    "softcap": dict(softcap=4.0),
    "alibi-H": dict(alibi_slopes="H"),
    "alibi-BH": dict(alibi_slopes="BH", window=(-1, 3)),
    "mask-bool": dict(mask="bool"),
    "mask-float": dict(mask="float", causal=True),
    "sinks": dict(sinks=True),
    "all": dict(causal=True, softcap=9.0, alibi_slopes="H", mask="bool", sinks=True),
}


def options(name, case, rng):
    """The option set `name` as NumPy arrays (slopes (H,) or (B, H), a mask
    broadcastable to (B, H, Tq, Tk) of its own shape, sinks (H,))."""
    opts = dict(OPTIONS[name])
    if "alibi_slopes" in opts:
        shape = (case.H,) if opts["alibi_slopes"] == "H" else (case.B, case.H)
        opts["alibi_slopes"] = rng.uniform(0.05, 0.5, shape).astype(np.float32)
    if opts.get("mask") == "bool":
        opts["mask"] = rng.random((case.Tq, case.Tk)) > 0.3
    elif opts.get("mask") == "float":
        opts["mask"] = rng.standard_normal((case.B, 1, 1, case.Tk)).astype(np.float32)
    if opts.get("sinks"):
        opts["sinks"] = rng.standard_normal(case.H).astype(np.float32)
    return opts
