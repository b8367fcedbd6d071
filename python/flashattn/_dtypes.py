"""The dtypes of q, k, v (and do, o and the gradients), by the name _core
takes: float32, float16 and ml_dtypes' bfloat16.

ml_dtypes costs most of a second to import, so it is imported only when a
call first meets or returns bfloat16 (issue 33: ``import flashattn`` within
0.3 s). An array of bfloat16 can only exist once ml_dtypes (or a framework
that loads it, such as JAX) has been imported, so recognising one costs
nothing more.
"""

from __future__ import annotations

import numpy as np

__all__ = ["name_of", "numpy_dtype", "bfloat16"]

_FLOAT32, _FLOAT16 = np.dtype(np.float32), np.dtype(np.float16)


def bfloat16() -> np.dtype:
    """ml_dtypes.bfloat16 as a NumPy dtype (importing ml_dtypes the first time)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def name_of(dtype: np.dtype) -> str | None:
    """'float32', 'float16' or 'bfloat16' for the dtypes the engines take, else None."""
    if dtype == _FLOAT32:
        return "float32"
    if dtype == _FLOAT16:
        return "float16"
    if dtype.name == "bfloat16" and dtype == bfloat16():
        return "bfloat16"
    return None


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a name that name_of gives."""
    return {"float32": _FLOAT32, "float16": _FLOAT16}.get(name) or bfloat16()
