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


LAYOUTS = ("bthd", "bhtd")


def layout(fn: str, value) -> str:
    """"bthd" (FlashAttention's: q is (B, T, H, D)) or "bhtd" (torch's and
    MLX's: (B, H, T, D))."""
    if not isinstance(value, str) or value not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {value!r}")
    return value


def to_bthd(x, layout: str):
    """A 4-d array of ``layout`` as a (B, T, H, D) view (arrays of other
    ranks as they are: the shape checks report them)."""
    return x.swapaxes(1, 2) if layout == "bhtd" and x.ndim == 4 else x


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


# ---- The score options (issue 16): each checked here for the engines and the
# reference alike. Shapes need the call's sizes, so each takes them.

def softcap(fn: str, value) -> float:
    """0 (off) or a positive real number, finite in float32."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: softcap must be a real number (0: off), got {type(value).__name__}")
    as_float = float(value)
    if not (as_float >= 0 and as_float <= _FLOAT32_MAX):  # NaN fails both
        raise ValueError(f"{fn}: softcap must be 0 (off) or positive and finite in float32, "
                         f"got {value!r}")
    return as_float


# The engines take float32 option arrays; the reference (the oracle) also
# float64 ones, so that its gradients can be checked by finite differences.
ENGINE_FLOATS = (np.float32,)
REFERENCE_FLOATS = (np.float32, np.float64)


def _float32_array(fn: str, name: str, value, what: str, floats=ENGINE_FLOATS) -> np.ndarray:
    """value as a float32 (or one of ``floats``) ndarray; refuses other
    dtypes rather than guessing a conversion."""
    value = array(fn, name, value) if isinstance(value, (np.ndarray, np.generic)) else value
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{fn}: {name} must be a float32 numpy.ndarray {what} or None, "
                        f"got {type(value).__name__}")
    if value.dtype not in floats:
        raise TypeError(f"{fn}: {name} must be float32 {what}, got {value.dtype}; "
                        f"convert with {name}.astype(np.float32)")
    return value


def alibi_slopes(fn: str, value, B: int, H: int, floats=ENGINE_FLOATS) -> np.ndarray | None:
    """None, or float32 slopes of shape (H,) or (B, H), returned as (B, H)
    (a zero-stride view for (H,)), contiguous along H."""
    if value is None:
        return None
    value = _float32_array(fn, "alibi_slopes", value, "of shape (H,) or (B, H)", floats)
    if value.shape not in ((H,), (B, H)):
        raise ValueError(f"{fn}: alibi_slopes must have shape (H,) = ({H},) or (B, H) = "
                         f"({B}, {H}), got {value.shape}")
    if not np.isfinite(value).all():
        raise ValueError(f"{fn}: alibi_slopes must be finite, got {value[~np.isfinite(value)][0]}")
    return np.broadcast_to(np.ascontiguousarray(value), (B, H))


def sinks(fn: str, value, H: int, floats=ENGINE_FLOATS) -> np.ndarray | None:
    """None, or float32 logits of shape (H,): finite, or -inf (that head has no sink)."""
    if value is None:
        return None
    value = _float32_array(fn, "sinks", value, "of shape (H,)", floats)
    if value.shape != (H,):
        raise ValueError(f"{fn}: sinks must have shape (H,) = ({H},), got {value.shape}")
    bad = np.isnan(value) | np.isposinf(value)
    if bad.any():
        raise ValueError(f"{fn}: sinks must be finite or -inf, got {value[bad][0]} for head "
                         f"{int(np.flatnonzero(bad)[0])}")
    return np.ascontiguousarray(value)


def mask(fn: str, value, B: int, H: int, Tq: int, Tk: int,
         floats=ENGINE_FLOATS) -> np.ndarray | None:
    """None, or a bool (True: may attend) or float32 (added to the scores)
    array broadcastable to (B, H, Tq, Tk), returned as a broadcast view of
    that shape: zero strides where it broadcasts, nothing copied."""
    if value is None:
        return None
    value = array(fn, "mask", value)
    if value.dtype != np.bool_ and value.dtype not in floats:
        raise TypeError(f"{fn}: mask must be bool (True: may attend) or float32 (added to the "
                        f"scores), got {value.dtype}")
    if value.dtype != np.bool_ and not value.dtype.isnative:
        raise TypeError(f"{fn}: mask has non-native byte order ({value.dtype.str})")
    size = value.dtype.itemsize
    if value.size and (not value.flags.aligned or any(s % size for s in value.strides)):
        # A field view of a structured array, say: the engines read whole
        # elements in place (a broadcast mask is never copied to (B, H, Tq, Tk)).
        raise ValueError(f"{fn}: mask must be aligned with strides that are whole {value.dtype} "
                         f"elements of {size} bytes, got strides {value.strides}"
                         f"{'' if value.flags.aligned else ' (misaligned)'}; pass "
                         f"np.ascontiguousarray(mask)")
    try:
        return np.broadcast_to(value, (B, H, Tq, Tk))
    except ValueError:
        raise ValueError(f"{fn}: mask must be broadcastable to (B, H, Tq, Tk) = "
                         f"{(B, H, Tq, Tk)}, got shape {value.shape}") from None


def cu_seqlens(fn: str, name: str, value, total: int) -> np.ndarray:
    """int32 (batch + 1,) prefix sums: 0 first, non-decreasing, ``total`` last.
    Other integer dtypes (int64 is what np.cumsum gives) are taken when every
    value fits int32, as an int32 copy of these batch + 1 numbers."""
    value = array(fn, name, value)
    if value.dtype.kind not in "iu":
        raise TypeError(f"{fn}: {name} must be int32 (or integers that fit it), got {value.dtype}")
    if value.dtype != np.int32 and value.size:
        info = np.iinfo(np.int32)
        low, high = int(value.min()), int(value.max())
        if low < info.min or high > info.max:
            raise ValueError(f"{fn}: {name} must fit int32, got values from {low} to {high}")
    value = value.astype(np.int32, copy=False)
    if value.ndim != 1 or value.shape[0] < 1:
        raise ValueError(f"{fn}: {name} must have shape (batch + 1,), got {value.shape}")
    if value[0] != 0:
        raise ValueError(f"{fn}: {name}[0] must be 0, got {int(value[0])}")
    down = np.flatnonzero(np.diff(value) < 0)
    if down.size:
        i = int(down[0]) + 1
        raise ValueError(f"{fn}: {name} must be non-decreasing; {name}[{i}] = {int(value[i])} "
                         f"< {name}[{i - 1}] = {int(value[i - 1])}")
    if value[-1] != total:
        i = value.shape[0] - 1
        raise ValueError(f"{fn}: {name}[{i}] = {int(value[-1])} must equal the number of rows "
                         f"{total}")
    return np.ascontiguousarray(value)


def max_seqlen(fn: str, name: str, value, cu: np.ndarray) -> int:
    """None (computed), or an int at least the longest sequence of ``cu``."""
    longest = int(np.diff(cu).max()) if cu.shape[0] > 1 else 0
    if value is None:
        return longest
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: {name} must be an int or None, got {type(value).__name__}")
    if int(value) < longest:
        raise ValueError(f"{fn}: {name} = {int(value)} is shorter than the longest sequence "
                         f"({longest})")
    return int(value)


def varlen_sequences(fn: str, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The varlen calls' shared checks: q and k are (total, heads, D), the
    prefix sums are valid for them and of one length, the max_seqlen_* hold.
    Returns the checked (cu_q, cu_k)."""
    for name, x in (("q", q), ("k", k)):
        if np.ndim(x) != 3:
            raise ValueError(f"{fn}: {name} must have 3 dimensions (total_{name}, heads, D), "
                             f"got shape {np.shape(x)}")
    cu_q = cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k = cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must have the same length "
                         f"(batch + 1), got {cu_q.shape[0]} and {cu_k.shape[0]}")
    max_seqlen(fn, "max_seqlen_q", max_seqlen_q, cu_q)
    max_seqlen(fn, "max_seqlen_k", max_seqlen_k, cu_k)
    return cu_q, cu_k
