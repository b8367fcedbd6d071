"""The MLX in-stream host: a call's plan run as ``mx.fast.metal_kernel``
dispatches in MLX's own stream, lazily, on MLX-allocated arrays.

Each piece of the metal engine's schedule is one dispatch of the kernel its
launch names, compiled by MLX from the source generated out of the shipped
shaders (call.mlx_kernel; one MLX kernel name per kernel and function-
constant values, so that a name always means one source), with that
piece's FlashParams. Arrays travel as 1-D buffers of at least 8 elements
(MLX passes smaller ones in the constant address space), each of the dtype
the kernel's parameter points at (a float32 buffer a `uchar*` parameter
reads is viewed as bytes, not copied); non-contiguous inputs are made
contiguous by MLX on the GPU. Outputs are new MLX arrays, so a launch cut
into several pieces gives each piece zero-initialised outputs, which are
OR-ed bitwise into one (exact: every element is written by one piece).

Command buffers are MLX's: it commits after a number of dispatches it
chooses. Outside transformations (``mx.grad``, ``mx.compile``), where
``mx.async_eval`` may run, the schedule's command-buffer boundaries are
kept by committing there without waiting.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from . import call as _call

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16,
           "uint8": mx.uint8, "int32": mx.int32, "uint32": mx.uint32, "bool": mx.bool_}
_NAMES = {v: k for k, v in _DTYPES.items()}
# MLX passes an input of fewer elements in the constant address space.
_MIN_ELEMENTS = 8


def dtype_name(dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"flashattn in-stream: no kernel takes {dtype} arrays") from None


def flat(x: mx.array) -> mx.array:
    """x as a 1-D buffer of at least 8 elements (row order; MLX copies a
    non-contiguous x on the GPU, once)."""
    x = x.reshape(-1)
    if x.size < _MIN_ELEMENTS:
        x = mx.concatenate([x, mx.zeros((_MIN_ELEMENTS - x.size,), x.dtype)])
    return x


def _as(x: mx.array, dtype: str) -> mx.array:
    """A 1-D buffer viewed as `dtype` (the same bytes)."""
    want = _DTYPES[dtype]
    return x if x.dtype == want else x.view(want)


def _bitwise_or(a: mx.array, b: mx.array) -> mx.array:
    return mx.bitwise_or(a.view(mx.uint8), b.view(mx.uint8)).view(a.dtype)


def _commit(arrays) -> None:
    """Ends MLX's command buffer here, without waiting, where MLX allows it."""
    try:
        mx.async_eval(*arrays)
    except ValueError as e:  # inside mx.grad / mx.compile / mx.vmap: MLX's boundaries
        if "transformation" not in str(e):
            raise


class Host:
    """Runs plans through `metal_kernel` (``mx.fast.metal_kernel``, or
    metal-sim's stand-in: flashattn._instream.sim)."""

    def __init__(self, metal_kernel=None):
        self.metal_kernel = metal_kernel or mx.fast.metal_kernel
        self._kernels: dict = {}

    def kernel(self, host_name: str, constants: tuple):
        spec = _call.mlx_kernel(host_name, constants)
        fn = self._kernels.get(spec.name)
        if fn is None:
            fn = self.metal_kernel(name=spec.name, input_names=[n for n, _ in spec.inputs],
                                   output_names=[n for n, _ in spec.outputs], source=spec.source,
                                   header=spec.header, ensure_row_contiguous=True)
            self._kernels[spec.name] = fn
        return spec, fn

    def run(self, plan: _call.Plan, slots: dict, itemsize: int) -> dict:
        """Runs every piece of `plan`; `slots` maps slot names to 1-D
        buffers (flat()); returns it with the outputs added."""
        slots = dict(slots)
        spare = _spare()  # for a score slot the call does not use
        for index, launch in enumerate(plan.launches):
            spec, fn = self.kernel(launch.kernel, launch.constants)
            inst = spec.instance
            pieces = [p for p in plan.pieces if p.launch == index]
            out_slots = [launch.buffers[p.buffer] for _, p in spec.outputs]
            out_dtypes = [inst.dtype(p) for _, p in spec.outputs]
            # At least 8 elements: a later launch may read it as an input.
            out_shapes = [(max(plan.nbytes(s, itemsize) // _call.ITEMSIZE[d], _MIN_ELEMENTS),)
                          for s, d in zip(out_slots, out_dtypes)]
            threads = launch.threadgroup
            result = None
            for piece in pieces:
                inputs = []
                for _, param in spec.inputs:
                    slot = launch.buffers[param.buffer]
                    if slot == "params":
                        x = _bytes(piece.params)
                    elif slot == "score":
                        x = _bytes(plan.score)
                    else:
                        x = slots.get(slot, spare)
                    inputs.append(_as(x, inst.dtype(param)))
                grid = tuple(g * t for g, t in zip(piece.grid, threads))
                if max(grid) >= 1 << 31:
                    raise ValueError(f"flashattn in-stream: {launch.kernel} needs a grid of "
                                     f"{grid} threads, beyond MLX's int32 grid")
                outs = fn(inputs=inputs, output_shapes=out_shapes,
                          output_dtypes=[_DTYPES[d] for d in out_dtypes], grid=grid,
                          threadgroup=threads, init_value=0 if len(pieces) > 1 else None)
                result = list(outs) if result is None else [
                    _bitwise_or(a, b) for a, b in zip(result, outs)]
                if piece.ends_command_buffer and piece is not plan.pieces[-1]:
                    _commit(result)
            for slot, x in zip(out_slots, result):
                slots[slot] = x
        return slots


# The host flashattn.mlx uses; tests set one over metal-sim's stand-in.
HOST: Host | None = None


def host() -> Host | None:
    """The in-stream host for MLX's default stream: on a Mac whose MLX has
    its Metal back end and computes on the GPU; else None (the wrappers
    then take the host-copy path)."""
    global HOST
    if HOST is None and mx.metal.is_available() and mx.default_device() == mx.gpu:
        HOST = Host()
    if HOST is None or (HOST.metal_kernel is mx.fast.metal_kernel and
                        mx.default_device() != mx.gpu):
        return None
    return HOST


@functools.lru_cache(maxsize=None)
def _spare() -> mx.array:
    return mx.zeros((_MIN_ELEMENTS,), mx.float32)


@functools.lru_cache(maxsize=4096)
def _bytes(data: bytes) -> mx.array:
    """A parameter struct as an MLX byte buffer (cached: plans repeat)."""
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def _layouts(fn, q, k, alibi_slopes, mask, sinks) -> dict:
    """The score options' layouts (the core reports bad q, k shapes first)."""
    if q.ndim != 4 or k.ndim != 4:
        return {}
    B, Tq, H, _ = q.shape
    options = _call.score_layouts(fn, B, H, Tq, k.shape[1],
                                  None if alibi_slopes is None else alibi_slopes.shape,
                                  None if mask is None else mask.shape,
                                  None if sinks is None else sinks.shape)
    if mask is not None:
        options["mask_bool"] = mask.dtype == mx.bool_
    return options


def _check_dtypes(fn, arrays: dict, lse=None, alibi_slopes=None, mask=None, sinks=None) -> str:
    """The call's dtype: every data array has q's (float32, float16 or
    bfloat16); lse, slopes and sinks are float32, a mask bool or float32."""
    dtype = arrays["q"].dtype
    for name, x in arrays.items():
        if x.dtype != dtype or dtype not in (mx.float32, mx.float16, mx.bfloat16):
            seen = ", ".join(f"{n} is {a.dtype}" for n, a in arrays.items())
            raise TypeError(f"{fn}: q, k, v (and do, o) must share one dtype, float32, float16 "
                            f"or bfloat16; {seen}")
    for name, x in (("lse", lse), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None and x.dtype != mx.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {x.dtype}")
    if mask is not None and mask.dtype not in (mx.bool_, mx.float32):
        raise TypeError(f"{fn}: mask must be bool or float32, got {mask.dtype}")
    return dtype_name(dtype)


def _take(x: mx.array, dtype: str, shape) -> mx.array:
    """The first prod(shape) elements of a (padded) output buffer, shaped."""
    x = _as(x, dtype)
    n = int(np.prod(shape))
    return (x if x.size == n else x[:n]).reshape(shape)


def _score_slots(alibi_slopes, mask, sinks) -> dict:
    slots = {}
    if alibi_slopes is not None:
        slots["alibi"] = flat(alibi_slopes)
    if mask is not None:
        slots["mask"] = flat(mask.astype(mx.uint8) if mask.dtype == mx.bool_ else mask)
    if sinks is not None:
        slots["sinks"] = flat(sinks)
    return slots


def forward(host: Host, q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
            alibi_slopes=None, mask=None, sinks=None):
    """(o, lse) of attention on MLX arrays, lazily, in MLX's stream: o like
    q in q's dtype, lse (B, H, Tq) float32. Shapes and dtypes are checked
    as the engines check them; values are not read (that would wait for them)."""
    fn = "attention"
    dtype = _check_dtypes(fn, {"q": q, "k": k, "v": v}, None, alibi_slopes, mask, sinks)
    plan = _call.plan("forward", dtype, _call.contiguous(q.shape), _call.contiguous(k.shape),
                      _call.contiguous(v.shape), causal=bool(causal),
                      window_left=int(window[0]), window_right=int(window[1]), scale=scale,
                      softcap=float(softcap), **_layouts(fn, q, k, alibi_slopes, mask, sinks))
    B, Tq, H = plan.B, plan.Tq, plan.H
    if plan.empty:
        o = mx.zeros(q.shape, q.dtype)
        lse = mx.full((B, H, Tq), -np.inf, mx.float32)
        if sinks is not None:
            lse = mx.broadcast_to(sinks[None, :, None], (B, H, Tq))
        return o, lse
    slots = {"q": flat(q), "k": flat(k), "v": flat(v)}
    slots.update(_score_slots(alibi_slopes, mask, sinks))
    out = host.run(plan, slots, _call.ITEMSIZE[dtype])
    return _take(out["o"], dtype, q.shape), _take(out["lse"], "float32", (B, H, Tq))


def backward(host: Host, do, q, k, v, o, lse, *, causal=False, window=(-1, -1), scale=None,
             softcap=0.0, alibi_slopes=None, mask=None, sinks=None):
    """(dq, dk, dv), and dsinks (H,) float32 with sinks, lazily, in MLX's
    stream; ``o`` and ``lse`` from forward() with the same options."""
    fn = "attention_backward"
    dtype = _check_dtypes(fn, {"q": q, "k": k, "v": v, "do": do, "o": o}, lse, alibi_slopes,
                          mask, sinks)
    plan = _call.plan("backward", dtype, _call.contiguous(q.shape), _call.contiguous(k.shape),
                      _call.contiguous(v.shape), do=_call.contiguous(do.shape),
                      o=_call.contiguous(o.shape), lse=_call.contiguous(lse.shape),
                      causal=bool(causal), window_left=int(window[0]),
                      window_right=int(window[1]), scale=scale, softcap=float(softcap),
                      **_layouts(fn, q, k, alibi_slopes, mask, sinks))
    B, Tq, H = plan.B, plan.Tq, plan.H
    if plan.empty:
        grads = (mx.zeros(q.shape, q.dtype), mx.zeros(k.shape, k.dtype),
                 mx.zeros(v.shape, v.dtype))
        delta = (do.astype(mx.float32) * o.astype(mx.float32)).sum(-1).transpose(0, 2, 1)
    else:
        slots = {"dout": flat(do), "q": flat(q), "k": flat(k), "v": flat(v), "o": flat(o),
                 "lse": flat(lse)}
        slots.update(_score_slots(alibi_slopes, mask, sinks))
        out = host.run(plan, slots, _call.ITEMSIZE[dtype])
        grads = (_take(out["dq"], dtype, q.shape), _take(out["dk"], dtype, k.shape),
                 _take(out["dv"], dtype, v.shape))
        delta = _take(out["delta"], "float32", (B, H, Tq))
    if sinks is None:
        return grads
    return grads + (sink_gradients(sinks, lse, delta),)


def sink_gradients(sinks, lse, delta):
    """dsinks[h] = -sum over b, i of exp(sink_h - lse) * delta (the formula
    run_backward applies for every engine, core/engine.cpp), from the
    delta the backward's preprocess kernel wrote; rows whose lse is -inf,
    and heads without a sink, add nothing."""
    s = sinks.astype(mx.float32)[None, :, None]
    dead = (lse == -np.inf) | (s == -np.inf)
    w = mx.where(dead, 0.0, mx.exp(mx.where(dead, 0.0, s - lse)))
    return -(w * delta).sum(axis=(0, 2))
