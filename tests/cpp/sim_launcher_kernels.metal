// Small kernels that exercise the metal-sim launcher itself (test_sim_launcher):
// SIMD-group functions, threadgroup memory isolation, and the misuse a GPU
// would not forgive (divergent barriers and SIMD-group calls).
#include <metal_stdlib>

using namespace metal;

// Each thread's SIMD-group results, 8 floats per thread.
kernel void simd_functions(device float* out [[buffer(0)]],
                           uint3 group_pos [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]]) {
    const float x = float(tid * 3 % 7) + 0.5f * float(sg);
    const uint base = (group_pos.x * 64 + tid) * 8;
    out[base + 0] = simd_sum(x);
    out[base + 1] = simd_max(x);
    out[base + 2] = simd_min(x);
    out[base + 3] = simd_shuffle(x, ushort((lane + 5) % 32));
    out[base + 4] = simd_broadcast(x, ushort(7));
    out[base + 5] = simd_shuffle_xor(x, ushort(1));
    out[base + 6] = simd_shuffle_down(x, ushort(3));
    out[base + 7] = simd_shuffle_up(x, ushort(2));
}

// Every thread reads its threadgroup slot before anyone writes it (which a
// real kernel must never do): a group must see garbage, never a value left
// by an earlier group. Then it writes, and a neighbour reads after a barrier.
kernel void threadgroup_isolation(device float* before [[buffer(0)]],
                                  device float* after [[buffer(1)]],
                                  uint3 group_pos [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]]) {
    FA_TG_ARRAY(float, tile, 64);
    const uint g = group_pos.x;
    before[g * 64 + tid] = tile[tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    tile[tid] = float(g * 1000 + tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    after[g * 64 + tid] = tile[(tid + 1) % 64];
}

// Half the threads return before a barrier the others wait at.
kernel void divergent_barrier(device float* out [[buffer(0)]],
                              uint3 group_pos [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]]) {
    (void)group_pos;  // the launcher's binding convention needs it present
    if (tid >= 16) return;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = 1.0f;
}

// Odd lanes call a SIMD-group reduction that even lanes skip.
kernel void divergent_simd(device float* out [[buffer(0)]],
                           uint3 group_pos [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]]) {
    (void)group_pos;  // the launcher's binding convention needs it present
    float x = float(tid);
    if (tid % 2 == 1) x = simd_sum(x);
    out[tid] = x;
}

// More threadgroup memory than an Apple GPU has (32 KiB).
kernel void too_much_threadgroup_memory(device float* out [[buffer(0)]],
                                        uint3 group_pos [[threadgroup_position_in_grid]],
                                        uint tid [[thread_index_in_threadgroup]]) {
    (void)group_pos;  // the launcher's binding convention needs it present
    FA_TG_ARRAY(float, big, 9000);
    big[tid] = 1.0f;
    out[tid] = big[tid];
}

// Half the lanes of the first SIMD group call a SIMD-group function, the
// other threads wait at a threadgroup barrier: each waits for the other.
kernel void simd_against_barrier(device float* out [[buffer(0)]],
                                 uint3 group_pos [[threadgroup_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]]) {
    (void)group_pos;  // the launcher's binding convention needs it present
    float x = float(tid);
    if (tid < 16) {
        x = simd_sum(x);
    } else {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[tid] = x;
}
