// The XLA FFI handlers behind flashattn.jax (cpp/bindings/xla_handlers.cpp):
// plain C ABI functions XLA's CPU runtime calls with a call frame.
#pragma once
#include "bindings/xla_ffi_abi.h"

namespace flashattn {

// args: q, k, v (float32, (..., Tq, H, D) and (..., Tk, Hkv, D)); rets: o, lse.
// Attributes causal, window_left, window_right, scale.
xla_ffi::Error* xla_attention_forward(xla_ffi::CallFrame* frame);

// args: do, q, k, v, o, lse; rets: dq, dk, dv. The same attributes.
xla_ffi::Error* xla_attention_backward(xla_ffi::CallFrame* frame);

}  // namespace flashattn
