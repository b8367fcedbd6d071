"""Property-based: random shapes, options, scales and memory layouts, in
every dtype, every engine against the float64 reference by the same rule as the grid
(hypothesis, bounded and derandomised so that CI sees the same examples)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st


from helpers import Case, check_backward, check_forward

LAYOUTS = ["contiguous", "fortran", "heads-major", "padded", "reversed-time", "strided-last-axis",
           "packed"]


def layout(x: np.ndarray, how: str, rng: np.random.Generator) -> np.ndarray:
    """x's values in another memory layout."""
    if how == "contiguous":
        return x
    if how == "fortran":
        return np.asfortranarray(x)
    if how == "heads-major":
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if how == "padded":
        big = rng.standard_normal(tuple(n + 2 for n in x.shape)).astype(x.dtype)
        big[1:-1, 1:-1, 1:-1, 1:-1] = x
        return big[1:-1, 1:-1, 1:-1, 1:-1]
    if how == "reversed-time":
        return np.ascontiguousarray(x[:, ::-1])[:, ::-1]
    if how == "strided-last-axis":
        wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if how == "packed":  # one of three arrays packed along a new axis 2
        packed = rng.standard_normal(x.shape[:2] + (3,) + x.shape[2:]).astype(x.dtype)
        packed[:, :, 1] = x
        return packed[:, :, 1]
    raise ValueError(how)


@st.composite
def calls(draw):
    Hkv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    D = draw(st.one_of(st.integers(1, 80), st.sampled_from([96, 111, 128, 200, 256])))
    side = st.one_of(st.just(-1), st.integers(0, 50))
    case = Case(
        B=draw(st.integers(1, 2)),
        Tq=draw(st.integers(1, 40)),
        Tk=draw(st.integers(1, 48)),
        H=Hkv * group,
        Hkv=Hkv,
        D=D,
        causal=draw(st.booleans()),
        window=(draw(side), draw(side)),
    )
    scale = draw(st.one_of(st.none(), st.floats(-1.5, 1.5, allow_nan=False, width=32)))
    layouts = draw(st.lists(st.sampled_from(LAYOUTS), min_size=4, max_size=4))
    seed = draw(st.integers(0, 2**32 - 1))
    return case, scale, layouts, seed


def arrays(case: Case, layouts, seed, dtype):
    """q, k, v, do of ``dtype``, each in its layout."""
    rng = np.random.default_rng(seed)
    shapes = [(case.B, case.Tq, case.H, case.D), (case.B, case.Tk, case.Hkv, case.D),
              (case.B, case.Tk, case.Hkv, case.D), (case.B, case.Tq, case.H, case.D)]
    return [layout(rng.standard_normal(s, dtype=np.float32).astype(dtype), how, rng)
            for s, how in zip(shapes, layouts)]


PROPERTY = settings(max_examples=50, deadline=None, derandomize=True, database=None)


@PROPERTY
@given(call=calls())
def test_forward_property(backend, dtype, call):
    case, scale, layouts, seed = call
    q, k, v, _ = arrays(case, layouts, seed, dtype)
    check_forward(backend, case, q, k, v, scale=scale)


@PROPERTY
@given(call=calls())
def test_backward_property(backend, dtype, call):
    case, scale, layouts, seed = call
    q, k, v, do = arrays(case, layouts, seed, dtype)
    check_backward(backend, case, q, k, v, do, scale=scale)
