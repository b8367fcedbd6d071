// Planted: `if constexpr` is C++17; MSL 3.1 is based on C++14.
#include <metal_stdlib>
using namespace metal;
kernel void planted(device float* x [[buffer(0)]]) {
    if constexpr (sizeof(float) == 4) { x[0] = 1.0f; }
}
