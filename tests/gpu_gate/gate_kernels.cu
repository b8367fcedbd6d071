// The translation unit gate.py compiles for each GPU target: the .metal
// sources (gate_sources.inc, generated) through the proxy <metal_stdlib>,
// as host-and-device functions, then one __global__ wrapper per kernel
// instantiation and threadgroup size (gate_list.inc, generated).
#include <metal_stdlib>

#include "gate_wrap.h"

#pragma clang force_cuda_host_device begin
#include "gate_sources.inc"
#pragma clang force_cuda_host_device end

#include "gate_list.inc"
