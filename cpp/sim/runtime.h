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

// SIMD-group rendezvous: each lane offers `bytes` (<= 16) bytes from
// `value`; returns once every lane of the SIMD group has offered, with the
// lanes' values copied to `lanes_out` (kSimdWidth slots of `bytes` each) and
// the group's lane count in *active_lanes.
void simd_exchange(const void* value, std::size_t bytes, void* lanes_out, unsigned* active_lanes);

// This thread's lane in its SIMD group.
unsigned simd_lane();

// Called from a kernel's threadgroup array declaration: lets the launcher
// check the 32 KiB limit and poison the array between threadgroups, so no
// group can read what another group left behind.
void note_threadgroup_array(void* data, std::size_t bytes);

}  // namespace fa_sim
