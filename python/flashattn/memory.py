"""Arrays in the metal engine's buffer pool, and the pool's controls.

On Apple silicon the CPU and GPU share memory: an array that lives in one of
the engine's pool buffers is read by the GPU in place. ``empty`` and
``asarray`` make such arrays; outputs of ``attention`` and
``attention_backward`` on the metal engine are such arrays already. Any other
input costs one copy into a pooled buffer per call, O(T·D), never O(T²).

Where the metal engine is not available, ``empty`` and ``asarray`` return
ordinary NumPy arrays and the pool functions raise ``RuntimeError``.
"""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np

from . import _core

__all__ = ["empty", "asarray", "metal_pool_stats", "clear_cache", "set_cache_limit"]


def _metal() -> bool:
    return hasattr(_core, "_metal_available") and bool(_core._metal_available())


def _require_metal(fn: str) -> None:
    if not _metal():
        raise RuntimeError(
            f"{fn}: the metal engine is not available on this machine "
            f"(backends here: {list(_core.backends())}); it needs macOS on Apple silicon"
        )


def _shape(fn: str, shape) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(operator.index(n) for n in shape)
    except TypeError:
        raise TypeError(f"{fn}: shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(n < 0 for n in dims):
        raise ValueError(f"{fn}: negative dimensions are not allowed, got {dims}")
    return dims


def _byte_bounds(x: np.ndarray) -> tuple[int, int]:
    """[low, high) addresses of the bytes x can reach (strides may be negative)."""
    low = high = x.__array_interface__["data"][0]
    if x.size == 0:
        return low, low
    for n, s in zip(x.shape, x.strides):
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    return low, high + x.itemsize


def _in_pool(x: np.ndarray) -> bool:
    """Whether all of x lies in one metal pool buffer handed out (never without metal)."""
    if not _metal():
        return False
    low, high = _byte_bounds(x)
    return high > low and bool(_core._metal_owns(low, high - low))


def empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array whose memory is a metal pool buffer.

    Passed to ``attention`` (whole, or sliced: q, k, v out of one packed qkv
    array), it is read by the GPU in place, without a copy. Its buffer returns
    to the pool when the array and every view of it are gone. Without the
    metal engine: ``numpy.empty(shape, dtype)``.
    """
    dims = _shape("empty", shape)
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"empty: dtype {dtype} holds Python objects; use numpy.empty")
    if not _metal():
        return np.empty(dims, dtype)
    raw = _core._metal_empty(math.prod(dims) * dtype.itemsize)
    return raw.view(dtype).reshape(dims)


def asarray(x, dtype=None) -> np.ndarray:
    """``x`` as an array in a metal pool buffer: ``x`` itself when it already
    lives in one (and has the dtype asked for), else a C-contiguous copy.

    Use it once for an input passed to many calls (a KV cache, weights): each
    call then reads it in place. Without the metal engine:
    ``numpy.asarray(x, dtype)``.
    """
    if not _metal():
        return np.asarray(x, dtype=dtype)
    if (
        isinstance(x, np.ndarray)
        and (dtype is None or x.dtype == np.dtype(dtype))
        and _in_pool(x)
    ):
        return x
    src = np.asarray(x, dtype=dtype)
    out = empty(src.shape, src.dtype)
    np.copyto(out, src)
    return out


def _contiguous_copy(x: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of x, for an input the engines cannot read in place:
    in a pool buffer when the metal engine exists (which then reads it in
    place: one copy in all), else in ordinary memory."""
    out = empty(x.shape, x.dtype)
    np.copyto(out, x)
    return out


def metal_pool_stats() -> dict:
    """Counters of the metal engine's buffer pool and of what crossed into it.

    ``active_bytes``/``active_buffers``: handed out to live arrays or calls;
    ``cached_bytes``/``cached_buffers``: idle, kept for reuse up to
    ``cache_limit``; ``allocations`` (new buffers), ``reuses``, ``evictions``;
    the path each input took: ``inputs_in_place`` (a pool array),
    ``inputs_no_copy`` (host memory bound in place over its page-rounded
    span, + ``inputs_no_copy_bytes``) or ``input_copies`` (one copy of its
    span, + ``input_copy_bytes``); for outputs ``outputs_in_place`` or
    ``output_copies`` (+ ``output_copy_bytes``); ``device``, ``page_size``, ``peak_active_bytes``.
    """
    _require_metal("metal_pool_stats")
    return dict(_core._metal_pool_stats())


def clear_cache() -> None:
    """Release every idle pool buffer (buffers of live arrays are kept)."""
    _require_metal("clear_cache")
    _core._metal_clear_cache()


def set_cache_limit(nbytes: int) -> int:
    """Keep at most ``nbytes`` of idle pool buffers (least recently used go
    first; 0 keeps none). Returns the previous limit."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
        raise TypeError(f"set_cache_limit: nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"set_cache_limit: nbytes must be >= 0, got {nbytes}")
    _require_metal("set_cache_limit")
    return int(_core._metal_set_cache_limit(int(nbytes)))
