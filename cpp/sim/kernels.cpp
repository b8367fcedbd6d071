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
#include "flash_decode.metal"
#include "flash_fwd.metal"
#include "flash_selftest.metal"

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
    t.push_back(make_kernel("flash_selftest_lanes", &flash_selftest_lanes));  // core/selftest.h
    // The names are the host_name strings of the .metal instantiations.
    // Every storage type (FA_STORAGE_TYPES: f32, f16, bf16) of every kernel.
#define FA_SIM_REGISTER_TYPE(NAME, T, UNUSED)                                                    \
    t.push_back(make_kernel("flash_bwd_preprocess_" #NAME, &flash_bwd_preprocess<T>));        \
    t.push_back(make_kernel("flash_fwd_merge_" #NAME, &flash_fwd_merge<T>));
    FA_STORAGE_TYPES(FA_SIM_REGISTER_TYPE, 0)
#define FA_SIM_REGISTER(NAME, T, HD)                                                            \
    t.push_back(make_kernel("flash_fwd_" #NAME "_hd" #HD, &flash_fwd<HD, T>));                \
    t.push_back(make_kernel("flash_decode_" #NAME "_hd" #HD, &flash_decode<HD, T>));          \
    t.push_back(make_kernel("flash_bwd_dq_" #NAME "_hd" #HD, &flash_bwd_dq<HD, T>));          \
    t.push_back(make_kernel("flash_bwd_dkdv_" #NAME "_hd" #HD, &flash_bwd_dkdv<HD, T>));
#define FA_SIM_REGISTER_TYPES(HD) FA_STORAGE_TYPES(FA_SIM_REGISTER, HD)
    FA_HEAD_BUCKETS(FA_SIM_REGISTER_TYPES)
#undef FA_SIM_REGISTER_TYPES
#undef FA_SIM_REGISTER
#undef FA_SIM_REGISTER_TYPE
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
