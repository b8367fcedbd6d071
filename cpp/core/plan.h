// A call turned into GPU work: the list of kernel launches, in order, with
// their grids and buffer bindings. Platform-free; the metal host and the
// metal-sim launcher execute the same Plan, so the simulator tests the
// dispatch logic that ships.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "flash_params.h"

namespace flashattn {

// What a kernel's [[buffer(n)]] argument is bound to.
enum class Slot : uint8_t {
    q, k, v, o, lse,           // forward inputs / outputs
    dout, dq, dk, dv,          // backward
    delta,                     // scratch: D = rowsum(dout * o), (B, H, Tq) floats
    partial_o,                 // scratch: split-KV decode's per-split unnormalised outputs
    partial_lse,               // scratch: split-KV decode's per-split (max, sum) statistics
    score,                     // the FlashScoreParams struct, by value (setBytes)
    alibi, mask, sinks,        // the score options' arrays (issue 16); any buffer when absent
    seqs,                      // varlen: int32 cu_seqlens_q then cu_seqlens_k (B + 1 each); any buffer when dense
    params,                    // the FlashParams struct, by value (setBytes)
};

constexpr size_t kSlotCount = size_t(Slot::params) + 1;

const char* slot_name(Slot s);

struct Dim3 {
    uint32_t x = 1, y = 1, z = 1;
};

// One value of a kernel's [[function_constant(index)]], as its bits: the
// pipeline is specialised with it (the metal host keys its cache by them).
struct FunctionConstant {
    enum class Type : uint8_t { boolean, int32, float32 };
    uint16_t index = 0;
    Type type = Type::int32;
    uint32_t bits = 0;  // boolean: 0 or 1; int32: the value; float32: its bit pattern
};

struct Launch {
    std::string kernel;          // Metal function name, spelling its specialisation
    std::vector<Slot> buffers;   // buffers[n] is bound to [[buffer(n)]]
    Dim3 grid;                   // threadgroups per grid
    Dim3 threadgroup;            // threads per threadgroup
    std::vector<FunctionConstant> constants;  // the specialisation, by index
};

// Device memory only the kernels read and write, allocated per call.
struct Scratch {
    Slot slot;
    int64_t floats;
};

struct Plan {
    FlashParams params;
    FlashScoreParams score{};  // read by the kernels only where params.score_mods says
    std::vector<Launch> launches;
    std::vector<Scratch> scratch;  // what the launches bind besides the call's arrays
};

// What a plan needs to know of the GPU it is for: its core count, which
// sizes split-KV decode (kGroupsPerCore threadgroups per core). The metal
// host reads it from the device (device.mm: the IORegistry's gpu-core-count,
// else the fewest cores of the architecture's class, the letter MLX reads
// from the architecture name); metal-sim and the tests pass the GPU they
// model, by default the smallest Apple GPU, an 8-core M1.
struct GpuInfo {
    int cores = 8;
};
constexpr int kGroupsPerCore = 8;

// Whether the forward of `p` runs the vector decode kernel
// (flash_decode_{dtype}_hd{HD}): MHA (group 1) with at most
// FA_DECODE_MAX_ROWS query rows, which the tiled kernel would give one
// SIMD group's 8 rows of its block of 32, each K and V row multiplied for
// them all. GQA decode stays tiled: its block packs the group's heads, so
// K and V are read once per kv head. The backward is tiled always.
bool uses_decode_kernel(const FlashParams& p);

// `dtype` is the storage type of q, k, v, o, do and the gradients: it
// picks the kernels' instantiation (flash_fwd_f16_hd64, ...); lse, delta
// and the split-KV partials are float32 whatever it is.
Plan plan_forward(const FlashParams& p, DType dtype = DType::f32, const GpuInfo& gpu = {});
Plan plan_backward(const FlashParams& p, DType dtype = DType::f32);

// The kernels' name for a storage type: "f32", "f16", "bf16" (FA_STORAGE_TYPES).
const char* kernel_dtype(DType dtype);

// The threads per threadgroup a kernel declares with
// [[max_total_threads_per_threadgroup(N)]] (FA_MAX_THREADS in the .metal
// sources): FA_THREADS for the tiled kernels (flash_fwd_*_hd*,
// flash_bwd_dq_*, flash_bwd_dkdv_*), 0 for a kernel that declares none.
// The metal host builds such a kernel's pipeline with the same N and refuses
// one whose limit comes out below it; metal-sim refuses a launch above it.
uint32_t declared_max_threads(const std::string& kernel);

}  // namespace flashattn
