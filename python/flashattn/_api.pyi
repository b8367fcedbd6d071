# Types of the public entry points (python/flashattn/_api.py): attention
# returns o, or (o, lse) when return_lse=True.
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

_F32 = npt.NDArray[np.float32]
_Array = npt.NDArray[Any]  # float32, float16 or ml_dtypes.bfloat16: outputs in the input's dtype
_Layout = Literal["bthd", "bhtd"]

def backends() -> list[str]: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
@overload
def attention(q: _Array, k: _Array, v: _Array, *, causal: bool = ...,
              window: tuple[int, int] = ..., scale: float | None = ..., softcap: float = ...,
              alibi_slopes: _Array | None = ..., mask: _Array | None = ...,
              sinks: _Array | None = ...,
              return_lse: Literal[False] = ..., layout: _Layout = ..., backend: str | None = ...) -> _Array: ...
@overload
def attention(q: _Array, k: _Array, v: _Array, *, causal: bool = ...,
              window: tuple[int, int] = ..., scale: float | None = ..., softcap: float = ...,
              alibi_slopes: _Array | None = ..., mask: _Array | None = ...,
              sinks: _Array | None = ...,
              return_lse: Literal[True], layout: _Layout = ..., backend: str | None = ...) -> tuple[_Array, _F32]: ...
@overload
def attention(q: _Array, k: _Array, v: _Array, *, causal: bool = ...,
              window: tuple[int, int] = ..., scale: float | None = ..., softcap: float = ...,
              alibi_slopes: _Array | None = ..., mask: _Array | None = ...,
              sinks: _Array | None = ...,
              return_lse: bool, layout: _Layout = ..., backend: str | None = ...) -> _Array | tuple[_Array, _F32]: ...
def attention_backward(do: _Array, q: _Array, k: _Array, v: _Array, o: _Array, lse: _Array, *,
                       causal: bool = ..., window: tuple[int, int] = ...,
                       scale: float | None = ..., softcap: float = ...,
                       alibi_slopes: _Array | None = ..., mask: _Array | None = ...,
                       sinks: _Array | None = ..., layout: _Layout = ...,
                       backend: str | None = ...) -> tuple[_Array, ...]: ...
def attention_varlen(q: _Array, k: _Array, v: _Array, cu_seqlens_q: _Array, cu_seqlens_k: _Array,
                     *, max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ...,
                     causal: bool = ..., window: tuple[int, int] = ...,
                     scale: float | None = ..., softcap: float = ...,
                     alibi_slopes: _Array | None = ..., sinks: _Array | None = ...,
                     return_lse: bool = ..., backend: str | None = ...) -> Any: ...
def attention_varlen_backward(do: _Array, q: _Array, k: _Array, v: _Array, o: _Array, lse: _Array,
                              cu_seqlens_q: _Array, cu_seqlens_k: _Array, *,
                              max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ...,
                              causal: bool = ..., window: tuple[int, int] = ...,
                              scale: float | None = ..., softcap: float = ...,
                              alibi_slopes: _Array | None = ..., sinks: _Array | None = ...,
                              backend: str | None = ...) -> tuple[_Array, ...]: ...
def merge_states(o_parts: Any, lse_parts: Any) -> tuple[_Array, _F32]: ...
