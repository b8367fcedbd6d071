// The XLA FFI handlers behind flashattn.jax (cpp/bindings/xla_handlers.cpp):
// plain C ABI functions XLA's CPU runtime calls with a call frame.
#pragma once
#include "bindings/xla_ffi_abi.h"

namespace flashattn {

// args: q, k, v ((..., Tq, H, D) and (..., Tk, Hkv, D), float32, float16 or
// bfloat16), then the score options' buffers; rets: o, lse. Attributes
// causal, window_left, window_right, scale, and softcap, alibi, mask, sinks
// (the .cpp file says how).
xla_ffi::Error* xla_attention_forward(xla_ffi::CallFrame* frame);

// args: do, q, k, v, o, lse, then the options' buffers; rets: dq, dk, dv, and
// dsinks with sinks. The same attributes.
xla_ffi::Error* xla_attention_backward(xla_ffi::CallFrame* frame);

// Varlen: args q (total_q, H, D), k, v (total_k, Hkv, D), cu_seqlens_q,
// cu_seqlens_k (int32), then alibi (batch, H) and sinks (H,); rets: o, lse (H, total_q).
xla_ffi::Error* xla_attention_varlen_forward(xla_ffi::CallFrame* frame);

// args: do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, then alibi and
// sinks; rets: dq, dk, dv, and dsinks with sinks.
xla_ffi::Error* xla_attention_varlen_backward(xla_ffi::CallFrame* frame);

}  // namespace flashattn
