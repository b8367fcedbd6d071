// The plans the metal host and metal-sim both execute: which kernels, with
// which buffers bound in [[buffer(n)]] order, on which grids.
#include <algorithm>
#include <string>
#include <vector>

#include "check.h"
#include "core/gpu_info.h"
#include "core/plan.h"
#include "flash_kernels.h"

using namespace flashattn;

namespace {

FlashParams params(int B, int Tq, int Tk, int H, int Hkv, int D) {
    FlashParams p{};
    p.B = B, p.Tq = Tq, p.Tk = Tk, p.H = H, p.Hkv = Hkv, p.D = D;
    p.group = H / Hkv;
    p.window_left = Tk;
    p.window_right = Tq;
    p.scale = 0.125f;
    return p;
}

bool same(const Dim3& a, uint32_t x, uint32_t y, uint32_t z) { return a.x == x && a.y == y && a.z == z; }

bool has_constant(const Launch& l, uint16_t index, uint32_t bits) {
    for (const FunctionConstant& c : l.constants)
        if (c.index == index) return c.bits == bits;
    return false;
}

}  // namespace

int main() {
    // Forward: one launch; a threadgroup of FA_SIMDGROUPS SIMD groups per
    // block of FA_BLOCK_ROWS query rows of a kv head; grid (blocks, Hkv, B).
    {
        const Plan plan = plan_forward(params(2, 113, 203, 8, 2, 64));
        CHECK(plan.launches.size() == 1);
        CHECK(plan.scratch.empty());
        CHECK(plan.params.Tq == 113 && plan.params.D == 64 && plan.params.kv_splits == 1);
        // Tq >= a block: every head's rows start a block of their own.
        CHECK(plan.params.rows_per_head == 128);
        const Launch& l = plan.launches[0];
        CHECK(l.kernel == "flash_fwd_f32_hd64");
        CHECK((l.buffers == std::vector<Slot>{Slot::q, Slot::k, Slot::v, Slot::o, Slot::lse, Slot::params,
                                              Slot::score, Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs}));
        CHECK(same(l.grid, 4 * 4, 2, 2));  // 4 heads per kv head x 4 blocks of 32 rows
        CHECK(same(l.threadgroup, FA_THREADS, 1, 1));
        CHECK(has_constant(l, FA_FC_HEAD_FULL, 1) && has_constant(l, FA_FC_HEAD_VEC16, 1));
    }
    // Function constants: D below its bucket, D not a multiple of 4; D = 60
    // fills 16-byte vectors of float32 (4) but not of 16-bit types (8).
    {
        const Launch l = plan_forward(params(1, 40, 40, 1, 1, 59)).launches[0];
        CHECK(has_constant(l, FA_FC_HEAD_FULL, 0) && has_constant(l, FA_FC_HEAD_VEC16, 0));
        CHECK(has_constant(plan_forward(params(1, 40, 40, 1, 1, 60)).launches[0], FA_FC_HEAD_VEC16, 1));
        CHECK(has_constant(plan_forward(params(1, 40, 40, 1, 1, 60), DType::f16).launches[0],
                           FA_FC_HEAD_VEC16, 0));
        CHECK(has_constant(plan_forward(params(1, 40, 40, 1, 1, 56), DType::bf16).launches[0],
                           FA_FC_HEAD_VEC16, 1));
    }
    // Short queries pack the heads of a GQA group into shared blocks.
    {
        const Plan plan = plan_forward(params(2, 4, 100, 8, 2, 64));
        CHECK(plan.params.rows_per_head == 4);
        CHECK(same(plan.launches[0].grid, 1, 2, 2));  // 4 heads x 4 rows = 16 rows: one block
    }
    // Decode with few threadgroups: keys split, then an exact merge.
    {
        // The default GPU is an 8-core M1: 8 x kGroupsPerCore = 64 threadgroups
        // aimed at; 4096 / 256 = 16 chunks allowed, 64 / 8 groups = 8.
        const Plan plan = plan_forward(params(1, 1, 4096, 32, 8, 128));
        CHECK(plan.params.kv_splits == 8);
        CHECK(plan.launches.size() == 2);
        const Launch& fwd = plan.launches[0];
        CHECK(fwd.kernel == "flash_fwd_f32_hd128");
        CHECK(same(fwd.grid, 1, 8, 8));
        CHECK((fwd.buffers == std::vector<Slot>{Slot::q, Slot::k, Slot::v, Slot::partial_o,
                                                Slot::partial_lse, Slot::params, Slot::score,
                                                Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs}));
        const Launch& merge = plan.launches[1];
        CHECK(merge.kernel == "flash_fwd_merge_f32");
        CHECK((merge.buffers == std::vector<Slot>{Slot::partial_o, Slot::partial_lse, Slot::o,
                                                  Slot::lse, Slot::params}));
        CHECK(same(merge.grid, 32 / FA_MERGE_ROWS_PER_GROUP, 1, 1));
        CHECK(plan.scratch.size() == 2);
        CHECK(plan.scratch[0].slot == Slot::partial_o && plan.scratch[0].floats == 8 * 32 * 128);
        CHECK(plan.scratch[1].slot == Slot::partial_lse && plan.scratch[1].floats == 8 * 32);
        // Short key ranges and many threadgroups are not split.
        CHECK(plan_forward(params(1, 1, 300, 32, 8, 128)).params.kv_splits == 1);
        CHECK(plan_forward(params(16, 1, 8192, 32, 8, 128)).params.kv_splits == 1);
        CHECK(plan_forward(params(1, 1, 1 << 20, 1, 1, 64)).params.kv_splits == FA_MAX_KV_SPLITS);
    }
    // MHA decode (group 1, at most FA_DECODE_MAX_ROWS query rows): the vector
    // kernel, a threadgroup of FA_DECODE_THREADS per (query row, head, batch
    // x split), split and merged as the tiled kernel is.
    {
        // 2 x 16 heads x 1 row = 32 groups; an 8-core GPU aims at 64: 2 splits.
        const Plan plan = plan_forward(params(2, 1, 4096, 16, 16, 128));
        CHECK(plan.params.kv_splits == 2);
        CHECK(plan.launches.size() == 2);
        const Launch& fwd = plan.launches[0];
        CHECK(fwd.kernel == "flash_decode_f32_hd128");
        CHECK(same(fwd.grid, 1, 16, 2 * 2));
        CHECK(same(fwd.threadgroup, FA_DECODE_THREADS, 1, 1));
        CHECK((fwd.buffers == std::vector<Slot>{Slot::q, Slot::k, Slot::v, Slot::partial_o,
                                                Slot::partial_lse, Slot::params, Slot::score,
                                                Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs}));
        CHECK(plan.launches[1].kernel == "flash_fwd_merge_f32");
        CHECK(same(plan.launches[1].grid, 32 / FA_MERGE_ROWS_PER_GROUP, 1, 1));
        // A 76-core GPU: 608 aimed at / 32 groups = 19, capped by 4096 / 256 keys.
        CHECK(plan_forward(params(2, 1, 4096, 16, 16, 128), DType::f32, GpuInfo{76}).params.kv_splits == 16);
        // Unsplit: o and lse bound directly; one threadgroup per query row.
        const Plan few = plan_forward(params(1, 3, 200, 4, 4, 64), DType::f16);
        CHECK(few.launches.size() == 1 && few.params.kv_splits == 1);
        CHECK(few.launches[0].kernel == "flash_decode_f16_hd64");
        CHECK(same(few.launches[0].grid, 3, 4, 1));
        CHECK(few.launches[0].buffers[3] == Slot::o && few.launches[0].buffers[4] == Slot::lse);
        CHECK(has_constant(few.launches[0], FA_FC_HEAD_FULL, 1));
        // More rows than one SIMD group's 8, or GQA: the tiled kernel.
        CHECK(plan_forward(params(1, FA_DECODE_MAX_ROWS, 200, 4, 4, 64)).launches[0].kernel ==
              "flash_decode_f32_hd64");
        CHECK(plan_forward(params(1, FA_DECODE_MAX_ROWS + 1, 200, 4, 4, 64)).launches[0].kernel ==
              "flash_fwd_f32_hd64");
        CHECK(plan_forward(params(1, 1, 200, 4, 2, 64)).launches[0].kernel == "flash_fwd_f32_hd64");
        // The backward of a decode call is tiled.
        CHECK(plan_backward(params(1, 1, 200, 4, 4, 64)).launches[1].kernel == "flash_bwd_dq_f32_hd64");
        CHECK(declared_max_threads("flash_decode_bf16_hd256") == FA_DECODE_THREADS);
    }
    // The split follows the GPU's core count (kGroupsPerCore threadgroups
    // per core), within the chunks' minimum length and the merge's 32 lanes.
    {
        static_assert(kGroupsPerCore == 8, "the counts below assume 8 threadgroups per core");
        const FlashParams decode = params(1, 1, 16384, 32, 8, 128);  // 8 kv heads: 8 groups
        const struct {
            int cores, splits;
        } gpus[] = {
            {8, 8},    // M1: 64 / 8
            {10, 10},  // M2, M3: 80 / 8
            {40, 32},  // M3 Max: 320 / 8 = 40, capped at the merge's 32
            {76, 32},  // M2 Ultra: 608 / 8 = 76, capped
        };
        for (const auto& gpu : gpus) {
            const Plan plan = plan_forward(decode, DType::f32, GpuInfo{gpu.cores});
            CHECK(plan.params.kv_splits == gpu.splits);
            CHECK(same(plan.launches[0].grid, 1, 8, uint32_t(gpu.splits)));
            // Every core gets threadgroups: at least one per core, unless the cap
            // or the keys' minimum chunk binds.
            CHECK(int64_t(8) * gpu.splits >= std::min(gpu.cores, 8 * FA_MAX_KV_SPLITS));
        }
        // More groups of their own: fewer splits on the same GPU. 4 batches x
        // 8 kv heads = 32 groups: an 8-core GPU wants 2 each, a 40-core one 10.
        const FlashParams batch4 = params(4, 1, 16384, 32, 8, 128);
        CHECK(plan_forward(batch4, DType::f32, GpuInfo{8}).params.kv_splits == 2);
        CHECK(plan_forward(batch4, DType::f32, GpuInfo{10}).params.kv_splits == 3);
        CHECK(plan_forward(batch4, DType::f32, GpuInfo{40}).params.kv_splits == 10);
        CHECK(plan_forward(batch4, DType::f32, GpuInfo{76}).params.kv_splits == 19);
        // Short caches keep chunks of at least 256 keys whatever the GPU.
        CHECK(plan_forward(params(1, 1, 1024, 32, 8, 128), DType::f32, GpuInfo{76})
                  .params.kv_splits == 4);
        // The core count as the metal host reads it: the registry's count, else
        // the fewest of the architecture's class letter (MLX's reading).
        CHECK(gpu_info_from(10, "applegpu_g15g").cores == 10);
        CHECK(gpu_info_from(0, "applegpu_g13g").cores == 7);
        CHECK(gpu_info_from(0, "applegpu_g13s").cores == 24);
        CHECK(gpu_info_from(0, "applegpu_g14d").cores == 48);
        CHECK(gpu_info_from(0, "applegpu_g16p").cores == 4);
        CHECK(gpu_info_from(0, "").cores == 8);
        CHECK(gpu_info_from(-1, "something else").cores == 8);
    }
    // Head size buckets: the smallest that holds D, D itself a run-time bound.
    {
        const int D[] = {1, 32, 33, 59, 64, 65, 96, 97, 111, 128, 129, 200, 256};
        const char* want[] = {"hd32", "hd32", "hd64", "hd64", "hd64", "hd96", "hd96",
                              "hd128", "hd128", "hd128", "hd256", "hd256", "hd256"};
        for (int n = 0; n < 13; ++n) {
            const std::string name = plan_forward(params(1, 9, 9, 1, 1, D[n])).launches[0].kernel;
            CHECK(name == std::string("flash_fwd_f32_") + want[n]);
        }
        CHECK_THROWS(std::invalid_argument, "head size", plan_forward(params(1, 5, 5, 1, 1, 257)));
        CHECK_THROWS(std::invalid_argument, "head size", plan_backward(params(1, 5, 5, 1, 1, 0)));
    }
    // Backward: preprocess, dq (over query rows), dkdv (over key rows of each kv head).
    {
        const Plan plan = plan_backward(params(2, 130, 65, 6, 3, 111));
        CHECK(plan.launches.size() == 3);
        CHECK(plan.scratch.size() == 1 && plan.scratch[0].slot == Slot::delta &&
              plan.scratch[0].floats == 2 * 6 * 130);
        const Launch& pre = plan.launches[0];
        CHECK(pre.kernel == "flash_bwd_preprocess_f32");
        CHECK((pre.buffers ==
               std::vector<Slot>{Slot::dout, Slot::o, Slot::delta, Slot::params, Slot::seqs}));
        CHECK(same(pre.grid, 3, 6, 2));
        CHECK(same(pre.threadgroup, FA_PREPROCESS_THREADS, 1, 1));
        const Launch& dq = plan.launches[1];
        CHECK(dq.kernel == "flash_bwd_dq_f32_hd128");
        CHECK((dq.buffers == std::vector<Slot>{Slot::q, Slot::k, Slot::v, Slot::dout, Slot::lse,
                                               Slot::delta, Slot::dq, Slot::params, Slot::score,
                                               Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs}));
        // SIMD-group pairs (FA_DQ_SPLIT): 2 heads per kv head x 10 blocks of 16 rows.
        CHECK(FA_DQ_SPLIT(128, 4) == 2 && FA_DQ_ROWS(128, 4) == 16);
        CHECK(same(dq.grid, 2 * 10, 3, 2));
        CHECK(same(dq.threadgroup, FA_THREADS, 1, 1));
        const Launch& dkdv = plan.launches[2];
        CHECK(dkdv.kernel == "flash_bwd_dkdv_f32_hd128");
        CHECK((dkdv.buffers == std::vector<Slot>{Slot::q, Slot::k, Slot::v, Slot::dout, Slot::lse,
                                                 Slot::delta, Slot::dk, Slot::dv, Slot::params,
                                                 Slot::score, Slot::alibi, Slot::mask,
                                                 Slot::sinks, Slot::seqs}));
        // SIMD-group pairs (FA_DKDV_SPLIT): 16 keys a threadgroup, the whole head.
        CHECK(FA_DKDV_SPLIT(128, 4) == 2 && FA_DKDV_KEYS(128, 4) == 16);
        CHECK(same(dkdv.grid, 5, 3, 2));
        CHECK(same(dkdv.threadgroup, FA_THREADS, 1, 1));
        // hd256 accumulates in column chunks: o in 2 of 128, dq and dk/dv in 4 of 64.
        CHECK(same(plan_forward(params(1, 40, 40, 4, 2, 200)).launches[0].grid, 4, 2 * 2, 1));
        const Plan wide = plan_backward(params(1, 40, 40, 4, 2, 200));
        CHECK(same(wide.launches[1].grid, 4, 2 * 4, 1));  // 2 heads x 2 blocks of 32 rows
        CHECK(same(wide.launches[2].grid, 2, 2 * 4, 1));
    }
    // A variable-length batch (issue 34) is one plan: the launches of a dense
    // call whatever the number of sequences, grid.z = the sequences, the
    // grid sized by the longest, FA_FC_VARLEN set and the sequences' table
    // bound; never split-KV, even for decode.
    {
        for (int seqs : {1, 7, 300}) {
            FlashParams p = params(seqs, 113, 203, 8, 2, 64);  // 113 / 203: the longest
            p.varlen_seqs = seqs;
            const Plan dense_f = plan_forward(params(seqs, 113, 203, 8, 2, 64));
            const Plan f = plan_forward(p);
            CHECK(f.launches.size() == 1 && f.launches.size() == dense_f.launches.size());
            CHECK(same(f.launches[0].grid, 4 * 4, 2, uint32_t(seqs)));
            CHECK(has_constant(f.launches[0], FA_FC_VARLEN, 1));
            CHECK(has_constant(dense_f.launches[0], FA_FC_VARLEN, 0));
            CHECK(f.launches[0].buffers.back() == Slot::seqs);
            const Plan b = plan_backward(p);
            CHECK(b.launches.size() == 3 && b.launches.size() == plan_backward(params(seqs, 113, 203, 8, 2, 64)).launches.size());
            for (const Launch& l : b.launches) {
                CHECK(l.grid.z == uint32_t(seqs));
                CHECK(l.buffers.back() == Slot::seqs);
                if (!l.constants.empty()) CHECK(has_constant(l, FA_FC_VARLEN, 1));
            }
            FlashParams decode = params(seqs, 1, 4096, 32, 8, 128);
            decode.varlen_seqs = seqs;
            CHECK(plan_forward(decode).params.kv_splits == 1);
            CHECK(plan_forward(decode).launches.size() == 1);
        }
    }
    // Empty calls never reach a plan (run_forward answers them).
    CHECK_THROWS(std::invalid_argument, "plan_forward", plan_forward(params(1, 0, 5, 1, 1, 8)));
    CHECK_THROWS(std::invalid_argument, "plan_backward", plan_backward(params(1, 5, 0, 1, 1, 8)));

    CHECK(std::string(slot_name(Slot::delta)) == "delta");
    CHECK(std::string(slot_name(Slot::params)) == "params");
    // Declared occupancy: every tiled kernel a plan launches declares
    // max_total_threads_per_threadgroup(N) with N its threadgroup size (the
    // host builds its pipeline for N); the O(T D) kernels declare none.
    {
        int tiled = 0;
        for (DType dt : {DType::f32, DType::f16, DType::bf16})
            for (int D = 1; D <= 256; D += 7)
                for (const Plan& plan : {plan_forward(params(1, 40, 300, 4, 2, D), dt),
                                         plan_forward(params(1, 1, 4096, 4, 2, D), dt),
                                         plan_backward(params(1, 40, 300, 4, 2, D), dt)})
                    for (const Launch& l : plan.launches) {
                        const uint32_t n = declared_max_threads(l.kernel);
                        const bool is_tiled = l.kernel.rfind("flash_fwd_merge", 0) != 0 &&
                                              l.kernel.rfind("flash_bwd_preprocess", 0) != 0;
                        CHECK(n == (is_tiled ? l.threadgroup.x * l.threadgroup.y * l.threadgroup.z : 0u));
                        tiled += is_tiled;
                    }
        CHECK(tiled > 0);
        CHECK(declared_max_threads("flash_fwd_merge_bf16") == 0);
        CHECK(declared_max_threads("flash_bwd_dkdv_f32_hd128") == FA_THREADS);
    }
    return flashattn_test::finish("test_plan");
}
