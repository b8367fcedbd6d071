// The cpu engine's two entry points, one per direction; cpu_engine.cpp wraps
// them as an Engine. Both trust a FlashParams from make_*_params and assume
// B, H, Tq, Tk >= 1 (run_forward/run_backward answer the empty calls).
// dispatch.cpp defines them: each calls the copy of the kernels compiled for
// the instruction set in use (cpu/isa.h).
#pragma once
#include "core/engine.h"

namespace flashattn::cpu {

void attention_forward(const FlashParams& p, const ForwardIO& io);
void attention_backward(const FlashParams& p, const BackwardIO& io);

// A variable-length batch in one parallel loop per phase (cpu/varlen.cpp).
void attention_forward_varlen(const Varlen& call, const ForwardIO& io);
void attention_backward_varlen(const Varlen& call, const BackwardIO& io);

}  // namespace flashattn::cpu
