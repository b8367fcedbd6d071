// metal-sim's fiber switch (fiber.h).
#include "sim/fiber.h"

#include <cstdint>

#ifdef FA_SIM_FAST_FIBERS
// fa_sim_fiber_switch(&from_sp, to_sp): pushes the callee-saved registers
// and the SSE/x87 control words, stores the stack pointer, loads the other
// one and pops the same in reverse. fa_sim_fiber_start is where a new
// fiber's first switch "returns" to: entry in rbx, its argument in r12.
asm(R"(
    .text
    .globl fa_sim_fiber_switch
    .hidden fa_sim_fiber_switch
    .type fa_sim_fiber_switch, @function
fa_sim_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fa_sim_fiber_switch, .-fa_sim_fiber_switch

    .globl fa_sim_fiber_start
    .hidden fa_sim_fiber_start
    .type fa_sim_fiber_start, @function
fa_sim_fiber_start:
    movq %r12, %rdi
    callq *%rbx
    ud2
    .size fa_sim_fiber_start, .-fa_sim_fiber_start
)");

extern "C" void fa_sim_fiber_switch(void** from_sp, void* to_sp);
extern "C" void fa_sim_fiber_start();
#endif

namespace flashattn::sim {

#ifdef FA_SIM_FAST_FIBERS
void fiber_prepare(FiberContext& fiber, char* stack, std::size_t bytes, void (*entry)(void*),
                   void* arg) {
    // The frame fa_sim_fiber_switch pops, from the top of a 16-byte aligned
    // stack: control words, r15, r14, r13, r12 (arg), rbx (entry), rbp, and
    // the return address fa_sim_fiber_start, which then runs with rsp 16-byte
    // aligned, so its call gives entry the alignment the ABI promises.
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15);
    uint64_t* frame = reinterpret_cast<uint64_t*>(top) - 8;
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    frame[0] = uint64_t(mxcsr) | (uint64_t(fpucw) << 32);
    frame[1] = frame[2] = frame[3] = 0;                   // r15, r14, r13
    frame[4] = reinterpret_cast<uint64_t>(arg);           // r12
    frame[5] = reinterpret_cast<uint64_t>(entry);         // rbx
    frame[6] = 0;                                         // rbp
    frame[7] = reinterpret_cast<uint64_t>(&fa_sim_fiber_start);
    fiber.sp = frame;
}

void fiber_switch(FiberContext& from, FiberContext& to) { fa_sim_fiber_switch(&from.sp, to.sp); }
#else
namespace {
struct Start {
    void (*entry)(void*);
    void* arg;
};
// makecontext passes int arguments only: the address of the fiber's Start
// travels as two halves.
void start(int hi, int lo) {
    const uintptr_t p = (uintptr_t(uint32_t(hi)) << 32) | uintptr_t(uint32_t(lo));
    const Start s = *reinterpret_cast<Start*>(p);
    s.entry(s.arg);
}
}  // namespace

void fiber_prepare(FiberContext& fiber, char* stack, std::size_t bytes, void (*entry)(void*),
                   void* arg) {
    // The Start record lives at the bottom of the fiber's own stack.
    Start* s = reinterpret_cast<Start*>(stack);
    *s = Start{entry, arg};
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = stack + 64;
    fiber.context.uc_stack.ss_size = bytes - 64;
    fiber.context.uc_link = nullptr;
    const uintptr_t p = reinterpret_cast<uintptr_t>(s);
    makecontext(&fiber.context, reinterpret_cast<void (*)()>(&start), 2, int(uint32_t(p >> 32)),
                int(uint32_t(p)));
}

void fiber_switch(FiberContext& from, FiberContext& to) { swapcontext(&from.context, &to.context); }
#endif

}  // namespace flashattn::sim
