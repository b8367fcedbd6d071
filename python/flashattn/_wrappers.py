"""What the framework wrappers (flashattn.torch, .jax, .mlx) share: their
framework's import with the extra to install, and every argument check of
a call, the NumPy API's own (_args, and the core's shape checks), on shapes
and Python values only, so that it runs at trace time under jax.jit and
torch.compile, before any engine is reached. One check for every entry point:
``causal="False"`` is a TypeError here as in ``fa.attention``."""

from __future__ import annotations

import dataclasses
import importlib
import math

from . import _args, _core

__all__ = ["require", "Options", "options", "score_shapes", "top_left_band", "dtype_name",
           "check_arrays"]


def require(module: str, extra: str, wrapper: str):
    """``import module``, or an ImportError that says which extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != module.split(".")[0]:
            raise  # something inside the framework is missing: its own message
        raise ModuleNotFoundError(
            f"{wrapper} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'flashattn[{extra}]'", name=e.name) from None


def dtype_name(dtype) -> str:
    """'float32', 'bfloat16', 'bool', ... for a torch, JAX, MLX or NumPy dtype."""
    return str(dtype).rpartition(".")[2]


# The dtypes the kernels take (float64 only through flashattn.torch, which
# checks its own).
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def check_arrays(fn: str, arrays: dict, ndim: int, words: str, *, is_array, kind: str,
                 astype: str) -> None:
    """q, k, v of a JAX or MLX call: arrays of the framework (`is_array`,
    named `kind` in the error), of one of FLOAT_DTYPES, all one dtype, with
    `ndim` dimensions (`words` says which). `astype` is the conversion the
    error suggests, e.g. "jnp.float32"."""
    for name, x in arrays.items():
        if not is_array(x):
            raise TypeError(f"{fn}: {name} must be {kind}, got {type(x).__name__}")
        if dtype_name(x.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{fn}: {name} must be float32, float16 or bfloat16, got {x.dtype}; "
                            f"convert with {name}.astype({astype})")
        if x.ndim != ndim:
            raise ValueError(f"{fn}: {name} must have {ndim} dimensions {words}, got shape "
                             f"{tuple(x.shape)}")
    dtypes = {name: dtype_name(x.dtype) for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        seen = ", ".join(f"{name} is {d}" for name, d in dtypes.items())
        raise TypeError(f"{fn}: q, k and v must share one dtype; {seen}. Convert them with "
                        f".astype(q.dtype)")


@dataclasses.dataclass(frozen=True)
class Options:
    """A call's options, checked: what the engines take."""
    causal: bool
    window: tuple
    scale: float | None  # None: 1/sqrt(D)
    softcap: float
    return_lse: bool
    layout: str

    def resolved_scale(self, D: int) -> float:
        return 1.0 / math.sqrt(D) if self.scale is None else self.scale


def options(fn: str, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
            return_lse=False, layout="bthd") -> Options:
    """The NumPy API's checks of the options that are not arrays."""
    return Options(causal=_args.flag(fn, "causal", causal), window=_args.window(fn, window),
                   scale=_args.scale(fn, scale), softcap=_args.softcap(fn, softcap),
                   return_lse=_args.flag(fn, "return_lse", return_lse),
                   layout=_args.layout(fn, layout))


def _bthd(shape, layout: str) -> tuple:
    shape = tuple(int(s) for s in shape)
    return (shape[0], shape[2], shape[1], shape[3]) if layout == "bhtd" and len(shape) == 4 \
        else shape


def check_shapes(fn: str, q_shape, k_shape, v_shape, opts: Options) -> tuple:
    """The core's shape checks (H a multiple of Hkv, D in 1..256, ...: the
    NumPy API's ValueErrors, naming the argument). Returns (B, Tq, H, D, Tk)."""
    q, k, v = (_bthd(s, opts.layout) for s in (q_shape, k_shape, v_shape))
    _core.check_call(fn, list(q), list(k), list(v), opts.causal, *opts.window, opts.scale)
    return q[0], q[1], q[2], q[3], k[1]


def check_varlen_shapes(fn: str, q_shape, k_shape, v_shape, opts: Options) -> None:
    """The varlen calls' shape checks: q (total_q, H, D), k and v
    (total_k, Hkv, D), checked as one sequence of each length would be."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 3:
            raise ValueError(f"{fn}: {name} must have 3 dimensions (total_{name[0]}, heads, D), "
                             f"got shape {tuple(shape)}")
    _core.check_call(fn, [1, *q_shape], [1, *k_shape], [1, *v_shape], opts.causal, *opts.window,
                     opts.scale)


def score_shapes(fn: str, B: int, H: int, Tq: int, Tk: int, *, alibi_slopes=None, mask=None,
                 sinks=None, float_names=("float32",)) -> None:
    """The score options' shapes and dtypes, each given as its array (or
    None): the NumPy API's rules (alibi (H,) or (B, H); a mask bool or float,
    broadcastable to (B, H, Tq, Tk); sinks (H,)), float32 unless the caller
    converts (``float_names``). Their values are checked where the call runs."""
    def need_float(name, x, what):
        if dtype_name(x.dtype) not in float_names:
            raise TypeError(f"{fn}: {name} must be float32 {what}, got {dtype_name(x.dtype)}; "
                            f"convert with {name}.astype(float32)")

    if alibi_slopes is not None:
        need_float("alibi_slopes", alibi_slopes, "of shape (H,) or (B, H)")
        if tuple(alibi_slopes.shape) not in ((H,), (B, H)):
            raise ValueError(f"{fn}: alibi_slopes must have shape (H,) = ({H},) or (B, H) = "
                             f"({B}, {H}), got {tuple(alibi_slopes.shape)}")
    if sinks is not None:
        need_float("sinks", sinks, "of shape (H,)")
        if tuple(sinks.shape) != (H,):
            raise ValueError(f"{fn}: sinks must have shape (H,) = ({H},), got "
                             f"{tuple(sinks.shape)}")
    if mask is not None:
        if dtype_name(mask.dtype) != "bool" and dtype_name(mask.dtype) not in float_names:
            raise TypeError(f"{fn}: mask must be bool (True: may attend) or float32 (added to "
                            f"the scores), got {dtype_name(mask.dtype)}")
        shape = tuple(mask.shape)
        full = (B, H, Tq, Tk)
        if len(shape) > 4 or any(m not in (1, f) for m, f in zip(shape[::-1], full[::-1])):
            raise ValueError(f"{fn}: mask must be broadcastable to (B, H, Tq, Tk) = {full}, got "
                             f"shape {shape}")


def top_left_band(Tq: int, Tk: int, left: int | None, right: int | None):
    """A band aligned top-left (query i sees keys i - left <= j <= i + right,
    None: unbounded; torch's and JAX's is_causal is right = 0) as flashattn's
    bottom-right one: (keys, (left', right')) where only the first ``keys``
    keys can be seen by any query and the band over them is the window
    (left', right') with -1 for unbounded; None when no such window exists
    (a bounded left side with Tq > keys + left: give the band as a mask)."""
    keys = Tk if right is None else max(0, min(Tk, Tq + right))
    shift = keys - Tq  # flashattn's query i sits at key position i + keys - Tq
    new_right = -1 if right is None else right - shift
    new_left = -1 if left is None else left + shift
    if (left is not None and new_left < 0) or (right is not None and new_right < 0):
        return None
    return keys, (new_left, new_right)
