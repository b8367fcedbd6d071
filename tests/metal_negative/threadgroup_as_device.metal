// Planted error for the strict address-space check: a threadgroup pointer
// passed where a device pointer is wanted. Apple's compiler rejects this;
// the plain C++ mode cannot see it, the strict mode must.
#include <metal_stdlib>

#include "flash_kernels.h"

using namespace metal;

inline float first(device const float* x) { return x[0]; }

kernel void planted_threadgroup_as_device(device float* out [[buffer(0)]],
                                          uint tid [[thread_index_in_threadgroup]]) {
    FA_TG_ARRAY(float, tile, 32);
    tile[tid] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = first(tile);
}
