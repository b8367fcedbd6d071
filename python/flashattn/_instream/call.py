"""What the in-stream hosts (MLX, torch) share: a call's plan from the
compiled core (the metal engine's own: kernels, grids, parameters, pieces
and command buffers), the kernel sources generated for it, and the shapes
of the score options as the core takes them."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from .. import _core
from . import source as _source

SHADERS = Path(__file__).resolve().parent.parent / "shaders"

# Bytes per element of the dtypes the kernels' buffers hold.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "int32": 4, "uint32": 4,
            "int8": 1, "int16": 2, "uint16": 2, "bool": 1}


@functools.lru_cache(maxsize=None)
def shaders() -> _source.ShaderSet:
    """The shaders this package was built from (installed beside it)."""
    return _source.ShaderSet.from_directory(SHADERS)


@functools.lru_cache(maxsize=None)
def mlx_kernel(host_name: str, constants: tuple) -> _source.MlxKernel:
    return shaders().mlx_kernel(host_name, constants)


@functools.lru_cache(maxsize=None)
def torch_source(host_name: str, constants: tuple) -> str:
    return shaders().torch_source(host_name, constants)


@dataclass(frozen=True)
class Launch:
    kernel: str
    buffers: tuple[str, ...]       # the slot bound to each [[buffer(n)]]
    grid: tuple[int, int, int]     # threadgroups
    threadgroup: tuple[int, int, int]
    constants: tuple               # (index, "boolean"|"int32"|"float32", bits)


@dataclass(frozen=True)
class Piece:
    launch: int
    origin: tuple[int, int, int]
    grid: tuple[int, int, int]
    params: bytes                  # the FlashParams of this piece (its origin in group_offset_*)
    ends_command_buffer: bool      # the metal engine commits its command buffer after it


@dataclass(frozen=True)
class Plan:
    empty: bool                    # no (query, key) pair: nothing to launch
    B: int
    Tq: int
    Tk: int
    H: int
    Hkv: int
    D: int
    params: bytes
    score: bytes
    launches: tuple[Launch, ...]
    scratch: dict
    pieces: tuple[Piece, ...]

    def nbytes(self, slot: str, itemsize: int) -> int:
        """Bytes of the array bound to `slot` (`itemsize`: the call's dtype's)."""
        if slot in self.scratch:
            return 4 * self.scratch[slot]
        if slot in ("q", "o", "dout", "dq"):
            return self.B * self.Tq * self.H * self.D * itemsize
        if slot in ("k", "v", "dk", "dv"):
            return self.B * self.Tk * self.Hkv * self.D * itemsize
        if slot in ("lse", "delta"):
            return 4 * self.B * self.H * self.Tq
        raise ValueError(f"flashattn in-stream: no size known for slot {slot!r}")


def plan(direction: str, dtype: str, q, k, v, **options) -> Plan:
    """The metal engine's plan of a call whose arrays have these layouts
    ((shape, strides in elements)); raises ValueError as the engines do.
    Cached by the call (and FLASHATTN_MAX_GROUPS_PER_PIECE, which the
    schedule reads). Sized for the GPU the metal engine plans for, where
    there is one (gpu_cores)."""
    return _plan(direction, dtype, q, k, v, os.environ.get("FLASHATTN_MAX_GROUPS_PER_PIECE"),
                 gpu_cores(), **options)


@functools.lru_cache(maxsize=None)
def gpu_cores() -> int | None:
    """The metal engine's GPU core count (read from the device: split-KV
    decode is sized to it), or None where there is no metal engine: the
    plan then models the smallest Apple GPU, as metal-sim does."""
    if getattr(_core, "_metal_available", lambda: False)():
        return int(_core._metal_gpu_cores())
    return None


@functools.lru_cache(maxsize=4096)
def _plan(direction: str, dtype: str, q, k, v, _pieces_knob, cores, do=None, o=None, lse=None,
          causal=False, window_left=-1, window_right=-1, scale=None, softcap=0.0, alibi=None,
          mask=None, mask_bool=False, sinks=None) -> Plan:
    d = _core._plan_call(direction, dtype, q, k, v, do=do, o=o, lse=lse, causal=causal,
                         window_left=window_left, window_right=window_right, scale=scale,
                         softcap=softcap, alibi=alibi, mask=mask, mask_bool=mask_bool,
                         sinks=sinks, gpu_cores=cores)
    ends = {first - 1 for first in d["command_buffers"][1:]}
    return Plan(
        empty=d["empty"], B=d["B"], Tq=d["Tq"], Tk=d["Tk"], H=d["H"], Hkv=d["Hkv"], D=d["D"],
        params=d["params"], score=d["score"],
        launches=tuple(Launch(x["kernel"], tuple(x["buffers"]), tuple(x["grid"]),
                              tuple(x["threadgroup"]), tuple(tuple(c) for c in x["constants"]))
                       for x in d["launches"]),
        scratch=dict(d["scratch"]),
        pieces=tuple(Piece(launch, tuple(origin), tuple(grid), params, i in ends)
                     for i, (launch, origin, grid, params) in enumerate(d["pieces"])))


def contiguous(shape) -> tuple:
    """(shape, strides) of a row-contiguous array."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(int(n) for n in shape), tuple(reversed(strides))


def broadcast(fn: str, name: str, shape, target, what: str) -> tuple:
    """The layout ((target, strides)) of a row-contiguous array of `shape`
    broadcast to `target`: stride 0 along every axis it broadcasts."""
    shape = tuple(int(n) for n in shape)
    if len(shape) > len(target):
        raise ValueError(f"{fn}: {name} must be broadcastable to {what} = {tuple(target)}, got "
                         f"shape {shape}")
    padded = (1,) * (len(target) - len(shape)) + shape
    _, own = contiguous(padded)
    strides = []
    for n, want, s in zip(padded, target, own):
        if n != want and n != 1:
            raise ValueError(f"{fn}: {name} must be broadcastable to {what} = {tuple(target)}, "
                             f"got shape {shape}")
        strides.append(0 if n == 1 else s)
    return tuple(int(t) for t in target), tuple(strides)


def score_layouts(fn: str, B: int, H: int, Tq: int, Tk: int, alibi_shape=None, mask_shape=None,
                  sinks_shape=None) -> dict:
    """The score options' layouts for _core._plan_call from the shapes of
    row-contiguous arrays (the MLX host passes them so): slopes (H,) or
    (B, H), a mask broadcastable to (B, H, Tq, Tk), sinks (H,)."""
    out = {}
    if alibi_shape is not None:
        alibi_shape = tuple(alibi_shape)
        if alibi_shape not in ((H,), (B, H)):
            raise ValueError(f"{fn}: alibi_slopes must have shape (H,) = ({H},) or (B, H) = "
                             f"({B}, {H}), got {alibi_shape}")
        out["alibi"] = broadcast(fn, "alibi_slopes", alibi_shape, (B, H), "(B, H)")
    if mask_shape is not None:
        out["mask"] = broadcast(fn, "mask", mask_shape, (B, H, Tq, Tk), "(B, H, Tq, Tk)")
    if sinks_shape is not None:
        if tuple(sinks_shape) != (H,):
            raise ValueError(f"{fn}: sinks must have shape (H,) = ({H},), got "
                             f"{tuple(sinks_shape)}")
        out["sinks"] = ((H,), (1,))
    return out
