// Stackful fibers for metal-sim's fiber execution mode: a context switch
// that saves only what the C++ ABI says a callee must preserve. On x86-64
// it is a few instructions (glibc's swapcontext also makes a signal-mask
// system call on every switch, which made the tiled kernels' thousands of
// SIMD-group rendezvous per threadgroup cost more than their arithmetic);
// elsewhere it is ucontext.
#pragma once
#include <cstddef>

#if defined(__x86_64__) && defined(__linux__)
#define FA_SIM_FAST_FIBERS 1
#else
#include <ucontext.h>
#endif

namespace flashattn::sim {

struct FiberContext {
#ifdef FA_SIM_FAST_FIBERS
    void* sp = nullptr;  // the saved stack pointer; the registers are on that stack
#else
    ucontext_t context;
#endif
};

// Makes `fiber` start entry(arg) on [stack, stack + bytes) at its first
// switch. entry must never return: it switches away for the last time.
void fiber_prepare(FiberContext& fiber, char* stack, std::size_t bytes, void (*entry)(void*),
                   void* arg);

// Saves the running context in `from` and resumes `to`.
void fiber_switch(FiberContext& from, FiberContext& to);

}  // namespace flashattn::sim
