// The .metal sources compiled as C++ through the <metal_stdlib> shim, and
// the table that finds each kernel by its Metal name and binds a launch's
// buffers and position builtins to its parameters.
#include <string>
#include <vector>

#include "sim/launcher.h"

// The kernels, unchanged. The shim's macros (device, constant, kernel, ...)
// live only until the #undefs below.
#include <metal_stdlib>

#include "flash_bwd.metal"
#include "flash_fwd.metal"

#undef device
#undef constant
#undef threadgroup
#undef thread
#undef kernel

#include "sim/bind.h"

namespace flashattn::sim {
namespace {

std::vector<Kernel> build_table() {
    std::vector<Kernel> t;
    // The names are the host_name strings of the .metal instantiations.
    t.push_back(make_kernel("flash_bwd_preprocess_f32", &flash_bwd_preprocess_f32));
    t.push_back(make_kernel("flash_fwd_merge_f32", &flash_fwd_merge_f32));
#define FA_SIM_REGISTER(HD)                                                       \
    t.push_back(make_kernel("flash_fwd_f32_hd" #HD, &flash_fwd<HD>));             \
    t.push_back(make_kernel("flash_bwd_dq_f32_hd" #HD, &flash_bwd_dq<HD>));       \
    t.push_back(make_kernel("flash_bwd_dkdv_f32_hd" #HD, &flash_bwd_dkdv<HD>));
    FA_HEAD_BUCKETS(FA_SIM_REGISTER)
#undef FA_SIM_REGISTER
    return t;
}

}  // namespace

const std::vector<Kernel>& kernels() {
    static const std::vector<Kernel> table = build_table();
    return table;
}

const Kernel* find_kernel(const std::string& name) {
    for (const Kernel& k : kernels())
        if (k.name == name) return &k;
    return nullptr;
}

}  // namespace flashattn::sim
