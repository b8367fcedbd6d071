// metal-sim's launcher: runs Plans (cpp/core/plan.h) on the CPU through the
// kernels compiled from shaders/*.metal, threadgroup after threadgroup, one
// CPU thread per GPU thread, barriers and SIMD-group functions honoured.
#pragma once
#include <array>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/plan.h"

namespace flashattn::sim {

// One [[buffer(n)]] argument: a device pointer, or (is_value) the bytes a
// `constant T&` argument refers to, as Metal's setBytes would pass them.
struct Binding {
    void* ptr = nullptr;
    bool is_value = false;
};

// The position builtins a kernel may take after its buffers: a prefix of
// uint3 [[threadgroup_position_in_grid]], uint [[thread_index_in_threadgroup]],
// uint [[thread_index_in_simdgroup]], uint [[simdgroup_index_in_threadgroup]].
struct Builtins {
    uint32_t group[3];
    uint32_t thread, lane, simdgroup;
};

// A kernel compiled into the simulator, under its Metal (host_name) name.
struct Kernel {
    std::string name;
    // Empty when the bindings fit the kernel's parameters, else why not.
    std::function<std::string(const std::vector<Binding>&)> check;
    std::function<void(const std::vector<Binding>&, const Builtins&)> run;
};

// Every kernel compiled from shaders/ (kernels.cpp).
const std::vector<Kernel>& kernels();
const Kernel* find_kernel(const std::string& name);

// Runs `grid` threadgroups of `group` threads of a kernel. Throws
// std::runtime_error naming the kernel and threadgroup when the kernel does
// what a GPU would not allow: threads of one group meeting different
// barriers (or a barrier some thread skipped by returning), a SIMD-group
// function not called by every lane, or more than 32 KiB of threadgroup memory.
// `constants` are the launch's [[function_constant]] values. Throws
// Interrupted (core/interrupt.h) before it starts, or between threadgroups,
// when the call is interrupted.
void run_launch(const Kernel& kernel, const std::vector<Binding>& buffers, Dim3 grid, Dim3 group,
                const std::vector<FunctionConstant>& constants = {});

// "fibers" or "threads": how launches run their GPU threads (launcher.cpp).
// Fibers on Linux unless the build has a sanitizer or FLASHATTN_SIM_THREADS=1.
const char* execution_mode();

// What the kernels did since reset_op_counts(): matrix multiply-accumulates,
// simdgroup_load and simdgroup_store calls and SIMD-group exchanges counted
// once per SIMD group, threadgroup barriers once per threadgroup
// (runtime.h, count_op). The inputs of docs/metal.md's cost model, which
// tests/python/test_metal_model.py checks against them.
struct OpCounts {
    uint64_t mma = 0, matrix_loads = 0, matrix_stores = 0, simd_exchanges = 0, barriers = 0;
};
OpCounts op_counts();
void reset_op_counts();
// The same per kernel (host name), since reset_op_counts(): launches run one
// at a time (run_launch holds a lock), so each launch's counts are its own.
std::map<std::string, OpCounts> op_counts_by_kernel();

// What a slot the call does not use is bound to (a score option it does not
// have), as the metal host binds its dedicated buffer there (metal/staging.h,
// Binding::unused): 16 bytes, 16-byte aligned, holding four quiet NaNs as
// float32, so a kernel that did read it would turn an output NaN or, read as
// a bool mask, mask keys out.
void* unused_slot_buffer();

// Runs every launch of a plan; slots[s] is the memory bound to Slot s
// (Slot::params is taken from plan.params, the plan's scratch is allocated here).
using SlotPointers = std::array<void*, kSlotCount>;
void run_plan(const Plan& plan, const SlotPointers& slots);

}  // namespace flashattn::sim
