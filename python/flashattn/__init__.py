"""flashattn: exact fused (FlashAttention-style) attention for NumPy arrays.

Forward and backward, causal or not, grouped-query, sliding window, any head
size up to 256, on the Apple GPU (Metal) or the CPU. Nothing of size T² is
ever stored: memory grows with B·H·T.

    import flashattn as fa
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = fa.attention_backward(do, q, k, v, o, lse, causal=True)

Differentiable wrappers, each imported only when asked for (this package
imports no framework): flashattn.torch, flashattn.jax, flashattn.mlx.
Ring attention across processes over MPI (mpi4py): flashattn.distributed.
"""

from . import _main_interpreter  # noqa: F401  first: refuses a subinterpreter (issue 12)
from . import reference
from ._api import (
    attention,
    attention_backward,
    attention_varlen,
    attention_varlen_backward,
    backends,
    get_num_threads,
    set_num_threads,
)
from ._merge import merge_states
from .memory import asarray, clear_cache, empty, metal_pool_stats, set_cache_limit

# The cpu engine's instruction-set dispatch (issue 13).
from ._isa import cpu_isa, cpu_isas

# An engine that failed to start is left out of backends(); say why, once.
from ._engines import warn_about_failed_engines as _warn_about_failed_engines

_warn_about_failed_engines()

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "merge_states",
    "backends",
    "reference",
    "set_num_threads",
    "get_num_threads",
    "empty",
    "asarray",
    "metal_pool_stats",
    "clear_cache",
    "set_cache_limit",
    "cpu_isa",
    "cpu_isas",
    "__version__",
]
