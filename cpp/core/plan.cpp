// Turns a validated call into the kernel launches that compute it: kernel
// names (spelling the head-size bucket), buffer bindings in [[buffer(n)]]
// order, grids and threadgroup sizes. The metal host and metal-sim both run
// exactly this, so the sizes chosen here are tested on every machine.
#include "core/plan.h"

#include <algorithm>
#include <stdexcept>

#include "flash_kernels.h"

namespace flashattn {

const char* slot_name(Slot s) {
    switch (s) {
        case Slot::q: return "q";
        case Slot::k: return "k";
        case Slot::v: return "v";
        case Slot::o: return "o";
        case Slot::lse: return "lse";
        case Slot::dout: return "dout";
        case Slot::dq: return "dq";
        case Slot::dk: return "dk";
        case Slot::dv: return "dv";
        case Slot::delta: return "delta";
        case Slot::partial_o: return "partial_o";
        case Slot::partial_lse: return "partial_lse";
        case Slot::score: return "score";
        case Slot::alibi: return "alibi";
        case Slot::mask: return "mask";
        case Slot::sinks: return "sinks";
        case Slot::seqs: return "seqs";
        case Slot::params: return "params";
    }
    return "?";
}

const char* kernel_dtype(DType dtype) {
    switch (dtype) {
        case DType::f32: return "f32";
        case DType::f16: return "f16";
        case DType::bf16: return "bf16";
    }
    throw std::invalid_argument("kernel_dtype: unknown dtype " + std::to_string(int(dtype)));
}

uint32_t declared_max_threads(const std::string& kernel) {
    auto starts = [&](const char* prefix) { return kernel.rfind(prefix, 0) == 0; };
    const bool tiled = starts("flash_bwd_dq_") || starts("flash_bwd_dkdv_") ||
                       (starts("flash_fwd_") && kernel.find("_hd") != std::string::npos);
    if (starts("flash_decode_")) return uint32_t(FA_DECODE_THREADS);
    return tiled ? uint32_t(FA_THREADS) : 0;
}

namespace {

uint32_t blocks(int64_t rows, int64_t per_block) {
    return uint32_t((rows + per_block - 1) / per_block);
}

int bucket_of(const char* fn, const FlashParams& p) {
    const int bucket = fa_head_bucket(p.D);
    if (bucket == 0)
        throw std::invalid_argument(std::string(fn) + ": head size D must be in 1..256, got " +
                                    std::to_string(p.D));
    return bucket;
}

void check_shape(const char* fn, const FlashParams& p) {
    if (p.B < 1 || p.Tq < 1 || p.Tk < 1 || p.H < 1 || p.Hkv < 1 || p.group < 1 ||
        p.group * p.Hkv != p.H)
        throw std::invalid_argument(std::string(fn) +
                                    ": needs B, Tq, Tk, H, Hkv >= 1 and H = group * Hkv (empty "
                                    "calls are answered before planning)");
}

FunctionConstant boolean(uint16_t index, bool value) {
    return {index, FunctionConstant::Type::boolean, value ? 1u : 0u};
}

// The specialisation every tiled kernel of a call shares; staging moves
// 16-byte vectors of the dtype (4 float32, 8 float16 or bfloat16 elements).
std::vector<FunctionConstant> head_constants(const FlashParams& p, int bucket, DType dtype) {
    const int vec16 = dtype == DType::f32 ? 4 : 8;
    return {boolean(FA_FC_HEAD_FULL, p.D == bucket), boolean(FA_FC_HEAD_VEC16, p.D % vec16 == 0),
            {FA_FC_SCORE_MODS, FunctionConstant::Type::int32, uint32_t(p.score_mods)},
            boolean(FA_FC_VARLEN, p.varlen_seqs > 0)};
}

// The query rows of a kv head in the packed numbering (FlashParams::
// rows_per_head): short query blocks share a threadgroup across the heads
// of the group (decode reads each K/V row once per kv head); longer ones
// get whole blocks, so no block spans two heads.
int32_t rows_per_head(const FlashParams& p) {
    if (p.Tq < FA_BLOCK_ROWS) return p.Tq;
    return int32_t(blocks(p.Tq, FA_BLOCK_ROWS) * FA_BLOCK_ROWS);
}

// Split-KV for decode: when the grid has only `groups` threadgroups (every
// kv head's queries fit one block: B * Hkv of them; the vector kernel: one
// per query row), too few to fill the GPU (an M1 has 8 cores, an M3 Max 40,
// an M2 Ultra 76, each running several threadgroups), each would walk all
// Tk keys alone. Then the keys are cut into chunks, enough for
// kGroupsPerCore threadgroups per core in all, each chunk at least
// kMinSplitKeys long so that its share of the merge (one partial row of D
// floats written and read again) stays small against its keys' K and V,
// at most FA_MAX_KV_SPLITS (the merge keeps one chunk per lane).
constexpr int64_t kMinSplitKeys = 256;
int32_t kv_splits(const FlashParams& p, int64_t groups, const GpuInfo& gpu) {
    // A varlen batch is one launch over every sequence (grid.z = sequences):
    // its rows are not one range to cut, and the merge would need the
    // sequences' table; decode over many sequences fills the GPU anyway.
    if (p.varlen_seqs > 0) return 1;
    const int64_t target = int64_t(std::max(gpu.cores, 1)) * kGroupsPerCore;
    const int64_t by_keys = p.Tk / kMinSplitKeys;
    const int64_t by_groups = (target + groups - 1) / groups;
    const int64_t splits = std::min<int64_t>({by_keys, by_groups, FA_MAX_KV_SPLITS});
    return int32_t(std::max<int64_t>(splits, 1));
}

const Dim3 kTiled{FA_THREADS, 1, 1};

}  // namespace

bool uses_decode_kernel(const FlashParams& p) {
    return p.group == 1 && p.Tq <= FA_DECODE_MAX_ROWS;
}

Plan plan_forward(const FlashParams& p, DType dtype, const GpuInfo& gpu) {
    check_shape("plan_forward", p);
    const int bucket = bucket_of("plan_forward", p);
    Plan plan;
    plan.params = p;
    plan.params.rows_per_head = rows_per_head(p);
    const std::string dt = kernel_dtype(dtype);
    // MHA decode: the vector kernel, one threadgroup per query row; else
    // the tiled kernel, a threadgroup per block of 32 packed rows (GQA
    // decode packs the group's heads into one, so K and V are staged once
    // per kv head) and chunk of o's columns.
    const bool decode = uses_decode_kernel(p);
    const uint32_t row_blocks = blocks(int64_t(p.group) * plan.params.rows_per_head, FA_BLOCK_ROWS);
    const int64_t groups = decode ? int64_t(p.B) * p.H * p.Tq : int64_t(p.B) * p.Hkv;
    const int32_t splits = decode || row_blocks == 1 ? kv_splits(p, groups, gpu) : 1;
    plan.params.kv_splits = splits;
    const std::string name = (decode ? "flash_decode_" : "flash_fwd_") + dt + "_hd" + std::to_string(bucket);
    const uint32_t chunks = uint32_t(bucket / FA_FWD_DCHUNK(bucket));
    const Dim3 grid = decode ? Dim3{uint32_t(p.Tq), uint32_t(p.H), uint32_t(p.B) * uint32_t(splits)}
                             : Dim3{row_blocks, uint32_t(p.Hkv) * chunks, uint32_t(p.B) * uint32_t(splits)};
    const Dim3 threads = decode ? Dim3{FA_DECODE_THREADS, 1, 1} : kTiled;
    if (splits == 1) {
        plan.launches.push_back(Launch{name,
                                       {Slot::q, Slot::k, Slot::v, Slot::o, Slot::lse, Slot::params,
                                        Slot::score, Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs},
                                       grid, threads, head_constants(p, bucket, dtype)});
        return plan;
    }
    // Each chunk's normalised o (float32 whatever the dtype) and lse, then
    // their exact merge, which writes o in the dtype.
    const int64_t rows = int64_t(p.B) * p.H * p.Tq;
    plan.scratch.push_back({Slot::partial_o, splits * rows * p.D});
    plan.scratch.push_back({Slot::partial_lse, splits * rows});
    plan.launches.push_back(Launch{
        name,
        {Slot::q, Slot::k, Slot::v, Slot::partial_o, Slot::partial_lse, Slot::params, Slot::score,
         Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs},
        grid, threads, head_constants(p, bucket, dtype)});
    plan.launches.push_back(Launch{"flash_fwd_merge_" + dt,
                                   {Slot::partial_o, Slot::partial_lse, Slot::o, Slot::lse, Slot::params},
                                   Dim3{blocks(rows, FA_MERGE_ROWS_PER_GROUP), 1, 1},
                                   Dim3{FA_MERGE_ROWS_PER_GROUP * FA_SIMD_WIDTH, 1, 1},
                                   {}});
    return plan;
}

Plan plan_backward(const FlashParams& p, DType dtype) {
    check_shape("plan_backward", p);
    const int bucket = bucket_of("plan_backward", p);
    const std::string dt = kernel_dtype(dtype);
    const std::string suffix = "_" + dt + "_hd" + std::to_string(bucket);
    Plan plan;
    plan.params = p;
    plan.params.rows_per_head = rows_per_head(p);
    plan.params.kv_splits = 1;
    plan.scratch.push_back({Slot::delta, int64_t(p.B) * p.H * p.Tq});
    plan.launches.push_back(Launch{
        "flash_bwd_preprocess_" + dt,
        {Slot::dout, Slot::o, Slot::delta, Slot::params, Slot::seqs},
        Dim3{blocks(p.Tq, FA_PREPROCESS_THREADS), uint32_t(p.H), uint32_t(p.B)},
        Dim3{FA_PREPROCESS_THREADS, 1, 1},
        {},
    });
    plan.launches.push_back(Launch{
        "flash_bwd_dq" + suffix,
        {Slot::q, Slot::k, Slot::v, Slot::dout, Slot::lse, Slot::delta, Slot::dq, Slot::params,
         Slot::score, Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs},
        Dim3{blocks(int64_t(p.group) * plan.params.rows_per_head, FA_DQ_ROWS(bucket, int(dtype_size(dtype)))),
             uint32_t(p.Hkv) * uint32_t(bucket / FA_DQ_DCHUNK(bucket)), uint32_t(p.B)},
        kTiled,
        head_constants(p, bucket, dtype),
    });
    // With score options the hd32 dK/dV kernel would spill registers (the
    // GPU gate's budget): such calls take the hd64 one, zero columns and all.
    const int dkdv_bucket = p.score_mods != 0 && bucket < 64 ? 64 : bucket;
    const uint32_t chunks = uint32_t(dkdv_bucket / FA_DKDV_DCHUNK(dkdv_bucket));
    plan.launches.push_back(Launch{
        "flash_bwd_dkdv_" + dt + "_hd" + std::to_string(dkdv_bucket),
        {Slot::q, Slot::k, Slot::v, Slot::dout, Slot::lse, Slot::delta, Slot::dk, Slot::dv,
         Slot::params, Slot::score, Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs},
        Dim3{blocks(p.Tk, FA_DKDV_KEYS(dkdv_bucket, int(dtype_size(dtype)))), uint32_t(p.Hkv) * chunks,
             uint32_t(p.B)},
        kTiled,
        head_constants(p, dkdv_bucket, dtype),
    });
    return plan;
}

}  // namespace flashattn
