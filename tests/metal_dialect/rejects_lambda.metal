// Planted: a lambda, valid C++14 but not MSL.
#include <metal_stdlib>
using namespace metal;
kernel void planted(device float* x [[buffer(0)]]) {
    auto twice = [](float v) { return 2.0f * v; };
    x[0] = twice(x[0]);
}
