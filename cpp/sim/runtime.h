// What a kernel compiled by metal-sim calls into while it runs: the
// threadgroup barrier, the SIMD-group rendezvous, and the registration of
// threadgroup arrays. Implemented by the launcher (launcher.cpp); declared
// here for the <metal_stdlib> shim. No Metal words in this header.
#pragma once
#include <cstddef>

namespace fa_sim {

// Threads per SIMD group, as on every Apple GPU.
constexpr unsigned kSimdWidth = 32;

// Waits until every thread of the threadgroup has reached the same barrier.
void threadgroup_barrier();

// The most bytes one lane offers in one SIMD-group exchange.
constexpr std::size_t kMaxExchangeBytes = 32;

// SIMD-group rendezvous: each lane offers `bytes` (<= kMaxExchangeBytes) bytes from
// `value`; returns once every lane of the SIMD group has offered, with the
// lanes' values copied to `lanes_out` (kSimdWidth slots of `bytes` each) and
// the group's lane count in *active_lanes.
void simd_exchange(const void* value, std::size_t bytes, void* lanes_out, unsigned* active_lanes);

// A SIMD-group collective computed once: each lane offers `bytes` (<=
// kMaxExchangeBytes) bytes; the last lane to arrive calls
// combine(offers, lanes, results) with the lanes' offers side by side and
// room for each lane's `result_bytes` (<= kMaxExchangeBytes) result; every
// lane then gets its own result in `result_out`. (A matrix multiply built on
// simd_exchange would have each of the 32 lanes redo the whole product.)
using SimdCombine = void (*)(const void* offers, unsigned lanes, void* results);
void simd_collective(const void* offer, std::size_t bytes, SimdCombine combine, void* result_out,
                     std::size_t result_bytes);

// This thread's lane in its SIMD group.
unsigned simd_lane();

// A planted fault for the self-test's tests (core/selftest.h): when set,
// the simulated simdgroup matrices use a lane layout other than the one the
// kernels assume (each lane's two columns swapped with its neighbour's), as a GPU
// whose layout differs would. Off unless set here or by
// FLASHATTN_SIM_LANE_FAULT=1 at the first launch.
bool lane_map_fault();
void set_lane_map_fault(bool on);

// A program-scope [[function_constant(index)]] of the kernels: the
// launcher writes each launch's value into `value` (size `bytes`) and sets
// *defined, or clears *defined when the launch supplies none.
void register_function_constant(unsigned index, std::size_t bytes, bool is_float, void* value,
                                bool* defined);

// The operations docs/metal.md's cost model counts, tallied per launch by
// the launcher (launcher.h, op_counts): per SIMD group (a matrix
// multiply-accumulate, a simdgroup_load, a simdgroup_store, a SIMD-group
// exchange: shuffle or reduction) or per threadgroup (a barrier). The shim
// calls count_op from every lane; lane 0 (thread 0 for a barrier) counts.
enum class Op { mma, matrix_load, matrix_store, simd_exchange, barrier };
void count_op(Op op);

// Called from a kernel's threadgroup array declaration: lets the launcher
// check the 32 KiB limit and poison the array between threadgroups, so no
// group can read what another group left behind.
void note_threadgroup_array(void* data, std::size_t bytes);

}  // namespace fa_sim
