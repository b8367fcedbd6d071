"""metal-sim's stand-ins for ``mx.fast.metal_kernel`` and
``torch.mps.compile_shader``: on a machine without Metal they run the
in-stream paths' kernels on the CPU, so that everything up to the GPU is
exercised here (tests, and the Mac bench's in-stream rows "as far as
metal-sim allows").

Each stand-in takes exactly what the in-stream host hands the framework,
builds the text the framework would compile (for MLX: its signature and
naming, reproduced in mlx_assembly; for torch: the source as given), and
runs metal-sim's compiled copy of that text, found by its key
(source.text_key); a text the build did not compile is an error, so a
generated source that drifted from what metal-sim checked cannot pass.
The function constants are read from the text's constants block, as
Apple's compiler would read them. Outputs the kernel does not write hold
NaN bytes (0xFF) unless an init_value asks for one, as MLX leaves them
uninitialised.

Eager and on host memory: MLX arrays are evaluated and copied to NumPy
(so no mx.compile), torch tensors must be CPU tensors. Slow: every GPU
thread is a CPU fiber.
"""

from __future__ import annotations

import collections
import functools
import re

import numpy as np

from .. import _core
from . import mlx_assembly as _assembly
from . import source as _source

_VALUE = re.compile(r"^#define FA_INSTREAM_VALUE_(\d+) (.+)$", re.M)

# The last dispatches the stand-ins ran, oldest first (tests compare them
# with the plan): dicts of kernel, grid and threadgroup (in threadgroups),
# constants, and the bytes bound to each argument.
CALLS: collections.deque = collections.deque(maxlen=4096)


@functools.lru_cache(maxsize=None)
def compiled_keys() -> frozenset:
    return frozenset(_core._sim_instream_keys())


def _key(text: str, what: str) -> str:
    key = _source.text_key(text)
    if key not in compiled_keys():
        raise RuntimeError(
            f"metal-sim has no compiled copy of the {what} generated here (key {key}): the "
            "build compiles every text the shaders instantiate, so this text differs from "
            "what the build generated (a generator or shader changed since; rebuild), or the "
            "host passed arguments the build did not foresee (an input of fewer than 8 "
            "elements, another dtype)")
    return key


def constants_of(text: str) -> list:
    """The (index, type, bits) function constants a text's block defines."""
    import struct

    begin = text.find(_source.CONSTANTS_BEGIN)
    end = text.find(_source.CONSTANTS_END, begin)
    out = []
    for index, value in _VALUE.findall(text[begin:end] if begin >= 0 else ""):
        value = value.strip()
        if value in ("true", "false"):
            out.append((int(index), "boolean", int(value == "true")))
        elif re.fullmatch(r"-?\d+", value):
            out.append((int(index), "int32", int(value) & 0xFFFFFFFF))
        else:
            f = {"NAN": float("nan"), "INFINITY": float("inf"),
                 "-INFINITY": float("-inf")}.get(value)
            f = float(value.rstrip("f")) if f is None else f
            out.append((int(index), "float32", struct.unpack("<I", struct.pack("<f", f))[0]))
    return out


def _groups(fn: str, threads, group) -> tuple:
    threads, group = tuple(int(x) for x in threads), tuple(int(x) for x in group)
    threads += (1,) * (3 - len(threads))
    group += (1,) * (3 - len(group))
    if any(t % g for t, g in zip(threads, group)):
        raise ValueError(f"{fn}: the stand-in runs whole threadgroups; grid {threads} is not a "
                         f"multiple of threadgroup {group}")
    return tuple(t // g for t, g in zip(threads, group)), group


# ---- MLX

def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None):
    """``mx.fast.metal_kernel``'s signature; the kernel runs on metal-sim."""
    import mlx.core as mx

    from .mlx_stream import _DTYPES, dtype_name

    if atomic_outputs:
        raise ValueError("the metal-sim stand-in does not take atomic outputs")

    def run(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
            init_value=None, verbose=False, stream=None):
        if template:
            raise ValueError("the metal-sim stand-in takes no template arguments")
        host = []
        for x in inputs:
            # MLX binds a row-contiguous copy (ensure_row_contiguous); the
            # kernel sees bytes.
            bits = np.array(x.reshape(-1).view(mx.uint8)) if x.size else np.zeros(0, np.uint8)
            host.append(((dtype_name(x.dtype), x.ndim, x.size), np.ascontiguousarray(bits)))
        out_names = [dtype_name(d) for d in output_dtypes]
        func, text, _ = _assembly.assemble(name, input_names, output_names, source, header,
                                           [h for h, _ in host], out_names)
        key = _key(text, f"MLX kernel {name}")
        outputs = []
        for shape, dtype in zip(output_shapes, out_names):
            n = int(np.prod(shape)) * {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1,
                                       "int32": 4, "uint32": 4, "bool": 1}[dtype]
            if init_value is None:
                outputs.append(np.full(n, 0xFF, np.uint8))
            else:
                filled = mx.full((int(np.prod(shape)),), init_value, _DTYPES[dtype])
                outputs.append(np.array(filled.view(mx.uint8)))
        groups, group = _groups(f"metal_kernel {name}", grid, threadgroup)
        constants = constants_of(header)
        CALLS.append(dict(kernel=name, grid=groups, threadgroup=group, constants=constants,
                          arguments={n: b.tobytes() for n, (_, b) in zip(input_names, host)}))
        _core._sim_instream_run(key, [b for _, b in host] + outputs, groups, group, constants)
        return [mx.array(o).view(_DTYPES[d]).reshape(tuple(shape))
                for o, d, shape in zip(outputs, out_names, output_shapes)]

    return run


# ---- torch

class _Library:
    """What ``torch.mps.compile_shader`` returns: kernels by host name."""

    def __init__(self, source: str):
        self.key = _key(source, "torch library")
        self.constants = constants_of(source)
        self.names = re.findall(r'FA_HOST_NAME\("(\w+)"\)', source.split(_source.CONSTANTS_END)[-1])

    def __getattr__(self, name):
        if name not in self.names:
            raise AttributeError(f"the library has no kernel {name!r} (it has {self.names})")

        def run(*args, threads=None, group_size=None, arg_casts=None, error_buf_idx=None):
            import torch

            buffers = []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    if a.device.type != "cpu":
                        raise ValueError("the metal-sim stand-in runs on CPU tensors")
                    buffers.append(a.data_ptr())
                elif isinstance(a, (list, tuple)):
                    cast = (arg_casts or {}).get(i) if isinstance(arg_casts, dict) else arg_casts
                    if cast != "uint8":
                        raise ValueError("the metal-sim stand-in passes lists as uint8 bytes only")
                    buffers.append(bytes(int(x) for x in a))
                else:
                    raise ValueError(f"the metal-sim stand-in does not bind {type(a).__name__}")
            groups, group = _groups(f"torch kernel {name}", threads, group_size)
            CALLS.append(dict(kernel=name, grid=groups, threadgroup=group,
                              constants=self.constants,
                              arguments={i: b for i, b in enumerate(buffers)
                                         if isinstance(b, bytes)}))
            _core._sim_instream_run(self.key, buffers, groups, group, self.constants)

        return run


def compile_shader(source: str) -> _Library:
    """``torch.mps.compile_shader``'s signature; its kernels run on metal-sim."""
    return _Library(source)
