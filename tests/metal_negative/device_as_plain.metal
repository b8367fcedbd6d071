// Planted error for the strict address-space check: a device pointer bound
// to a plain (thread address space) pointer, which Apple's compiler rejects.
#include <metal_stdlib>

#include "flash_kernels.h"

using namespace metal;

kernel void planted_device_as_plain(device float* out [[buffer(0)]],
                                    uint tid [[thread_index_in_threadgroup]]) {
    float* plain = out;
    plain[tid] = 0.0f;
}
