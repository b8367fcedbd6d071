"""The torch MPS in-stream host: a call's plan run as
``torch.mps.compile_shader`` kernels in torch's MPS stream, on the MPS
tensors themselves, outputs allocated by torch; no copy to the host and no
wait.

Each kernel the plan names is compiled once by torch from the source
generated out of the shipped shaders (call.torch_source: the kernel
template unchanged, one instantiation, the function constants as
constexpr values), and each piece of the metal engine's schedule is one
dispatch, writing its part of the outputs in place. Arguments are bound as
the .metal kernel declares them: tensors at their storage offset (q, k, v,
do, o with their own strides, so slices of a packed qkv tensor are not
copied; a last axis that is not contiguous is copied once), FlashParams
and FlashScoreParams by value (``arg_casts``; torch versions without it
get them as small MPS byte tensors). At the end of each of the schedule's
command buffers torch's is committed, without waiting, by recording an
MPS event.
"""

from __future__ import annotations

import torch

from . import call as _call

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# The devices whose tensors the in-stream path takes (tests add "cpu",
# with metal-sim's compile_shader).
DEVICES = ("mps",)


def supported() -> bool:
    """torch can compile Metal source and run it in its MPS stream."""
    mps = getattr(torch, "mps", None)
    return (mps is not None and hasattr(mps, "compile_shader") and
            torch.backends.mps.is_available())


def _commit() -> None:
    """Commits torch's MPS command buffer here, without waiting for it."""
    event = getattr(torch.mps, "Event", None) or getattr(getattr(torch.mps, "event", None),
                                                         "Event", None)
    if event is not None and torch.backends.mps.is_available():
        event().record()


class Host:
    """Runs plans through `compile_shader` (``torch.mps.compile_shader``, or
    metal-sim's stand-in: flashattn._instream.sim)."""

    def __init__(self, compile_shader=None, commit=None):
        self.compile_shader = compile_shader or torch.mps.compile_shader
        self.commit = commit or _commit
        self._kernels: dict = {}
        self._arg_casts = True  # torch takes arg_casts (2.7+); else byte tensors

    def kernel(self, host_name: str, constants: tuple):
        """The kernel, from its library (compiled once per kernel and constants)."""
        library = self._kernels.get((host_name, constants))
        if library is None:
            library = self.compile_shader(_call.torch_source(host_name, constants))
            self._kernels[(host_name, constants)] = library
        return getattr(library, host_name)

    def _dispatch(self, fn, args, by_value, threads, group, device):
        if self._arg_casts:
            try:
                fn(*[list(a) if i in by_value else a for i, a in enumerate(args)],
                   threads=threads, group_size=group, arg_casts={i: "uint8" for i in by_value})
                return
            except TypeError as e:
                if "arg_casts" not in str(e) and "incompatible" not in str(e):
                    raise
                self._arg_casts = False
        fn(*[torch.frombuffer(bytearray(a), dtype=torch.uint8).to(device) if i in by_value
             else a for i, a in enumerate(args)], threads=threads, group_size=group)

    def run(self, plan: _call.Plan, slots: dict, outputs: dict, device) -> dict:
        """Runs every piece of `plan`; `slots` maps slot names to the call's
        tensors, `outputs` the slots the plan writes to tensors of their
        size (scratch is allocated here)."""
        slots = dict(slots)
        slots.update(outputs)
        for name, floats in plan.scratch.items():
            slots[name] = torch.empty(max(floats, 1), dtype=torch.float32, device=device)
        shaders = _call.shaders()
        for piece in plan.pieces:
            launch = plan.launches[piece.launch]
            fn = self.kernel(launch.kernel, launch.constants)
            params = shaders.instance(launch.kernel).kernel.params
            args, by_value = [], set()
            for p in params:
                if p.buffer is None:
                    continue
                slot = launch.buffers[p.buffer]
                if slot == "params":
                    args.append(piece.params)
                    by_value.add(len(args) - 1)
                elif slot == "score":
                    args.append(plan.score)
                    by_value.add(len(args) - 1)
                else:  # a score slot the call does not use reads nothing: bind q
                    args.append(slots.get(slot, slots["q"]))
            threads = [g * t for g, t in zip(piece.grid, launch.threadgroup)]
            self._dispatch(fn, args, by_value, threads, list(launch.threadgroup), device)
            if piece.ends_command_buffer and piece is not plan.pieces[-1]:
                self.commit()
        return slots


# The host flashattn.torch uses for tensors on DEVICES; tests set one over
# metal-sim's stand-in (and add "cpu" to DEVICES).
HOST: Host | None = None


def host(device) -> Host | None:
    """The in-stream host for tensors on `device`: MPS tensors, where torch
    has compile_shader; else None (the wrappers then copy through the host)."""
    global HOST
    if device.type not in DEVICES:
        return None
    if HOST is None and device.type == "mps" and supported():
        HOST = Host()
    return HOST


def _layout(x: torch.Tensor) -> tuple:
    return tuple(x.shape), tuple(x.stride())


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last axis is contiguous (any other strides), else one copy."""
    return x if x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _check_dtypes(fn, arrays: dict, lse=None, alibi_slopes=None, mask=None, sinks=None) -> str:
    dtype = arrays["q"].dtype
    if dtype not in _DTYPES or any(x.dtype != dtype for x in arrays.values()):
        seen = ", ".join(f"{n} is {a.dtype}" for n, a in arrays.items())
        raise TypeError(f"{fn}: q, k, v (and do, o) must share one dtype, float32, float16 or "
                        f"bfloat16; {seen}")
    for name, x in (("lse", lse), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None and x.dtype != torch.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {x.dtype}")
    if mask is not None and mask.dtype not in (torch.bool, torch.float32):
        raise TypeError(f"{fn}: mask must be bool or float32, got {mask.dtype}")
    return _DTYPES[dtype]


def _score(fn, q, k, alibi_slopes, mask, sinks) -> tuple[dict, dict]:
    """The score options' layouts for the plan and tensors to bind (views,
    broadcast with zero strides, never expanded)."""
    if q.dim() != 4 or k.dim() != 4:
        return {}, {}
    B, Tq, H, _ = q.shape
    Tk = k.shape[1]
    layouts, tensors = {}, {}
    if alibi_slopes is not None:
        _call.score_layouts(fn, B, H, Tq, Tk, alibi_shape=alibi_slopes.shape)
        a = torch.broadcast_to(alibi_slopes.contiguous(), (B, H))
        layouts["alibi"], tensors["alibi"] = _layout(a), a
    if mask is not None:
        _call.score_layouts(fn, B, H, Tq, Tk, mask_shape=mask.shape)
        m = torch.broadcast_to(mask, (B, H, Tq, Tk))
        layouts["mask"], tensors["mask"] = _layout(m), m
        layouts["mask_bool"] = mask.dtype == torch.bool
    if sinks is not None:
        _call.score_layouts(fn, B, H, Tq, Tk, sinks_shape=sinks.shape)
        s = sinks.contiguous()
        layouts["sinks"], tensors["sinks"] = _layout(s), s
    return layouts, tensors


def forward(host: Host, q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
            alibi_slopes=None, mask=None, sinks=None):
    """(o, lse) on MPS tensors in torch's stream: o (B, Tq, H, D) contiguous
    in q's dtype, lse (B, H, Tq) float32."""
    fn = "attention"
    dtype = _check_dtypes(fn, {"q": q, "k": k, "v": v}, None, alibi_slopes, mask, sinks)
    q, k, v = (_last_contiguous(x) for x in (q, k, v))
    layouts, score = _score(fn, q, k, alibi_slopes, mask, sinks)
    plan = _call.plan("forward", dtype, _layout(q), _layout(k), _layout(v), causal=bool(causal),
                      window_left=int(window[0]), window_right=int(window[1]), scale=scale,
                      softcap=float(softcap), **layouts)
    B, Tq, H = plan.B, plan.Tq, plan.H
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    if plan.empty:
        o.zero_()
        lse.copy_(sinks[None, :, None].expand(B, H, Tq) if sinks is not None
                  else torch.full_like(lse, float("-inf")))
        return o, lse
    host.run(plan, dict(q=q, k=k, v=v, **score), dict(o=o, lse=lse), q.device)
    return o, lse


def backward(host: Host, do, q, k, v, o, lse, *, causal=False, window=(-1, -1), scale=None,
             softcap=0.0, alibi_slopes=None, mask=None, sinks=None):
    """(dq, dk, dv), and dsinks (H,) float32 with sinks, on MPS tensors in
    torch's stream; ``o`` and ``lse`` from forward() with the same options."""
    fn = "attention_backward"
    dtype = _check_dtypes(fn, {"q": q, "k": k, "v": v, "do": do, "o": o}, lse, alibi_slopes,
                          mask, sinks)
    do, q, k, v, o = (_last_contiguous(x) for x in (do, q, k, v, o))
    lse = lse.contiguous()
    layouts, score = _score(fn, q, k, alibi_slopes, mask, sinks)
    plan = _call.plan("backward", dtype, _layout(q), _layout(k), _layout(v), do=_layout(do),
                      o=_layout(o), lse=_layout(lse), causal=bool(causal),
                      window_left=int(window[0]), window_right=int(window[1]), scale=scale,
                      softcap=float(softcap), **layouts)
    B, Tq, H = plan.B, plan.Tq, plan.H
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    if plan.empty:
        for g in grads:
            g.zero_()
        delta = (do.float() * o.float()).sum(-1).transpose(1, 2)
    else:
        slots = host.run(plan, dict(dout=do, q=q, k=k, v=v, o=o, lse=lse, **score),
                         dict(dq=grads[0], dk=grads[1], dv=grads[2]), q.device)
        delta = slots["delta"][:B * H * Tq].view(B, H, Tq)
    if sinks is None:
        return grads
    return grads + (sink_gradients(sinks, lse, delta),)


def sink_gradients(sinks, lse, delta):
    """dsinks[h] = -sum over b, i of exp(sink_h - lse) * delta, as
    run_backward computes it for every engine (core/engine.cpp)."""
    s = sinks.float()[None, :, None]
    dead = (lse == float("-inf")) | (s == float("-inf"))
    w = torch.where(dead, torch.zeros_like(lse), torch.exp(torch.where(dead, 0.0, s - lse)))
    return -(w * delta).sum(dim=(0, 2))
