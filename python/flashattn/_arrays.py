"""Arrays from other libraries as NumPy arrays, without a copy.

The NumPy API reads any array that lives in host memory: NumPy arrays as
they are, then objects exposing ``__dlpack__`` (torch CPU tensors, JAX CPU
arrays, MLX arrays), then the buffer protocol or ``__array_interface__``.
Each is viewed in place (``np.from_dlpack``, ``np.asarray`` on a buffer);
nothing here copies, and no framework is imported: objects are recognised by
the protocols they expose. Dtype and layout checks come after, in ``_api``.

bfloat16 has no DLPack or buffer-protocol code NumPy reads, so a torch or
MLX bfloat16 array is viewed as its 16-bit integers (``x.view(int16)``, no
copy) and those as ``ml_dtypes.bfloat16``; a JAX one through ``__array__``,
which gives ml_dtypes' bfloat16 itself.
"""

from __future__ import annotations

import sys

import numpy as np

from . import _dtypes

__all__ = ["host_array"]

# DLPack device types whose memory the CPU can read where it is: the host,
# CUDA pinned host memory, and Metal (unified memory on Apple silicon).
_DL_CPU, _DL_CUDA_HOST, _DL_METAL = 1, 3, 8


def _requires_grad_error(fn: str, name: str) -> TypeError:
    return TypeError(
        f"{fn}: {name} is a torch tensor that requires grad; flashattn's NumPy API does "
        f"not record gradients. Use flashattn.torch.attention (differentiable, with the "
        f"fused backward), or pass {name}.detach()"
    )


def _not_an_array_error(fn: str, name: str, x) -> TypeError:
    return TypeError(
        f"{fn}: {name} must be a numpy.ndarray of float32 or an array in host memory "
        f"(DLPack, buffer protocol or __array_interface__), got {type(x).__name__}; "
        f"use np.asarray({name}, dtype=np.float32)"
    )


def _from_dlpack(fn: str, name: str, x) -> tuple[np.ndarray | None, str]:
    """x viewed through DLPack, or (None, why) when NumPy cannot view it that
    way (the caller then tries the buffer protocol)."""
    try:
        device_type = int(x.__dlpack_device__()[0])
    except (AttributeError, TypeError, ValueError, IndexError):
        device_type = _DL_CPU  # no device query: np.from_dlpack will say
    if device_type not in (_DL_CPU, _DL_CUDA_HOST, _DL_METAL):
        raise TypeError(
            f"{fn}: {name} lives on a device the CPU cannot read (DLPack device type "
            f"{device_type}); move it to the host first, e.g. {name}.cpu()"
        )
    try:
        return np.from_dlpack(x), ""
    except (BufferError, TypeError, RuntimeError, ValueError) as e:
        # NumPy reads only kDLCPU capsules; unified memory (Metal) and dtypes
        # NumPy has no DLPack code for (bfloat16) come back here.
        return None, str(e)


def _bfloat16_bits(x):
    """A torch or MLX bfloat16 array as a same-shaped view of its 16-bit
    integers (which DLPack carries), or None for anything else."""
    if str(getattr(x, "dtype", "")).rpartition(".")[2] != "bfloat16":
        return None
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return x.view(sys.modules["torch"].int16)
    if module == "mlx":
        return x.view(sys.modules["mlx.core"].uint16)
    return None


def host_array(fn: str, name: str, x) -> np.ndarray:
    """x as a NumPy array sharing its memory; TypeError for anything else.

    Only the protocols say what x is; a torch tensor is recognised by its
    module name so that no framework is imported here.
    """
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch" and getattr(x, "requires_grad", False):
        raise _requires_grad_error(fn, name)
    bits = _bfloat16_bits(x)
    if bits is not None:
        return host_array(fn, name, bits).view(_dtypes.bfloat16())
    if hasattr(x, "__array__") and str(getattr(x, "dtype", "")) == "bfloat16":
        return np.asarray(x)  # a JAX array: NumPy's view of its host buffer
    why = ""
    if hasattr(x, "__dlpack__"):
        a, why = _from_dlpack(fn, name, x)
        if a is not None:
            return a
    has_buffer = hasattr(x, "__array_interface__")
    if not has_buffer:
        try:
            memoryview(x).release()
            has_buffer = True
        except TypeError:
            pass
    # str and bytes expose buffers too, but hold no floats: not arrays.
    if has_buffer and not isinstance(x, (str, bytes, bytearray)):
        try:
            return np.asarray(x)
        except (TypeError, ValueError, BufferError):
            pass
    if why:
        raise TypeError(
            f"{fn}: {name} ({type(x).__name__} of {getattr(x, 'dtype', '?')}) cannot be read "
            f"in place through DLPack ({why}); pass a float32 array in host memory"
        )
    raise _not_an_array_error(fn, name, x)
