"""The options of a call, checked and normalised in one place for the engines
(``_api``) and the reference alike: each check raises the README's exception,
its message starting with the function and naming the argument and the value
seen. Shapes are checked by the compiled core (``_core.check_call``)."""

from __future__ import annotations

import math
import numbers

import numpy as np

# The cpu engine's thread count: set_num_threads and FLASHATTN_NUM_THREADS
# (cpp/cpu/thread_pool.cpp says the same).
MAX_THREADS = 1024

# Any window side at least this large is past every key (sizes are < 2**30),
# so it is unbounded; clamping keeps huge ints inside int64.
_UNBOUNDED_SIDE = 2**62

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def flag(fn: str, name: str, value) -> bool:
    """A bool or numpy.bool_: "False" or 0 are not taken for an answer."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def window(fn: str, value) -> tuple[int, int]:
    """(left, right) as ints in -1..2**62: a tuple or list of two ints, each
    -1 (unbounded) or at least 0."""
    def bad():
        return ValueError(
            f"{fn}: window must be a tuple or list of two ints (left, right), each -1 "
            f"(unbounded) or at least 0; got {value!r}"
        )

    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise bad()
    for side in value:
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
            raise bad()
        if int(side) < -1:
            raise bad()
    left, right = value
    return min(int(left), _UNBOUNDED_SIDE), min(int(right), _UNBOUNDED_SIDE)


def scale(fn: str, value) -> float | None:
    """None, or a real number that is finite in float32 (the engines' precision)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: scale must be a real number or None, got {type(value).__name__}")
    try:
        as_float = float(value)
    except OverflowError:  # an int past float64 (10**400)
        as_float = math.inf
    if not math.isfinite(as_float) or abs(as_float) > _FLOAT32_MAX:
        raise ValueError(f"{fn}: scale must be finite in float32 (|scale| <= {_FLOAT32_MAX:.7g}), "
                         f"got {value!r}")
    return as_float


def num_threads(fn: str, value) -> int:
    """An int in 1..MAX_THREADS."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: n must be an int, got {type(value).__name__}")
    if not 1 <= int(value) <= MAX_THREADS:
        raise ValueError(f"{fn}: n must be in 1..{MAX_THREADS}, got {int(value)}")
    return int(value)


def array(fn: str, name: str, value) -> np.ndarray:
    """A numpy.ndarray, not a subclass whose meaning the engines would drop."""
    if isinstance(value, np.ma.MaskedArray):
        raise TypeError(
            f"{fn}: {name} is a masked array; its mask would be ignored. Pass "
            f"{name}.filled(value) for the values, and mask keys with causal= or window="
        )
    if isinstance(value, np.generic):
        raise TypeError(
            f"{fn}: {name} must be a 4-d numpy.ndarray of float32, got a NumPy scalar "
            f"({type(value).__name__}); {name} has the shape (B, T, heads, D)"
        )
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"{fn}: {name} must be a numpy.ndarray of float32, got {type(value).__name__}; "
            f"use np.asarray({name}, dtype=np.float32)"
        )
    return value
