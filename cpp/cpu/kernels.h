// The entry points of one per-ISA copy of the cpu engine's kernels: the
// build compiles forward.cpp, backward.cpp and peak.cpp once per instruction
// set into namespace flashattn::cpu::<isa>, and dispatch.cpp calls the copy
// this CPU runs best. The kernel files declare their own copy with
// FLASHATTN_CPU_KERNELS(FLASHATTN_CPU_ISA); dispatch.cpp declares each one.
#pragma once
#include "core/engine.h"
#include "cpu/call_phases.h"

#define FLASHATTN_CPU_KERNELS(isa)                                           \
    namespace flashattn::cpu::isa {                                          \
    void attention_forward(const FlashParams& p, const ForwardIO& io);       \
    void attention_backward(const FlashParams& p, const BackwardIO& io);     \
    std::unique_ptr<CallPhases> forward_phases(const FlashParams& p, const ForwardIO& io,     \
                                               Sharing sharing);                            \
    std::unique_ptr<CallPhases> backward_phases(const FlashParams& p, const BackwardIO& io,   \
                                                Sharing sharing);                           \
    double measure_fma_peak(double seconds, int threads);                    \
    int vector_width();                                                      \
    }
