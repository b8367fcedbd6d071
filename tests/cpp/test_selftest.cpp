// The GPU engines' self-test (core/selftest.h) on metal-sim: the lane probe
// passes on the layout the kernels assume and fails on a planted other one;
// the known-answer calls pass for every kind of pipeline and reach every
// pipeline a plan can have; a planted fault fails them, and the engine is
// left out with a reason naming the pipeline.
#include <cstdlib>
#include <string>
#include <vector>

#include "check.h"
#include "core/params.h"
#include "core/selftest.h"
#include "core/varlen.h"
#include "engines/factories.h"
#include "flash_kernels.h"
#include "sim/runtime.h"

using namespace flashattn;

namespace {

FlashParams shape(int B, int Tq, int Tk, int H, int Hkv, int D, int score_mods = 0) {
    FlashParams p{};
    p.B = B, p.Tq = Tq, p.Tk = Tk, p.H = H, p.Hkv = Hkv, p.D = D;
    p.group = H / Hkv;
    p.window_left = Tk;
    p.window_right = 0;
    p.scale = 0.125f;
    p.kv_splits = 1;
    p.score_mods = score_mods;
    return p;
}

// A varlen batch of sequences of these lengths, (total, H, D) float32
// arrays, causal, with `score_mods`' options (softcap, ALiBi, sinks).
struct VarlenCall {
    std::vector<float> q, k, v, alibi, sinks;
    Sequences seqs;
    Varlen call;
    VarlenCall(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k, int H,
               int Hkv, int D, int score_mods = 0) {
        std::vector<int32_t> cu_q{0}, cu_k{0};
        for (size_t b = 0; b < lens_q.size(); ++b) {
            cu_q.push_back(cu_q.back() + lens_q[b]);
            cu_k.push_back(cu_k.back() + lens_k[b]);
        }
        const int64_t n = int64_t(cu_q.size()), tq = cu_q.back(), tk = cu_k.back();
        q.assign(size_t(tq * H * D), 0.5f);
        k.assign(size_t(tk * Hkv * D), 0.5f);
        v = k;
        seqs = make_sequences("test", cu_q.data(), n, cu_k.data(), n, tq, tk);
        auto view3 = [&](std::vector<float>& a, int64_t rows, int heads) {
            TensorView t;
            t.data = a.data();
            t.dtype = DType::f32;
            t.shape = {rows, heads, D};
            t.strides = {int64_t(heads) * D, D, 1};
            return t;
        };
        AttentionOptions options;
        options.causal = true;
        ScoreOptions score;
        if (score_mods & FA_SCORE_SOFTCAP) score.softcap = 5.0;
        if (score_mods & FA_SCORE_ALIBI) {
            alibi.assign(size_t((n - 1) * H), 0.1f);
            TensorView a;
            a.data = alibi.data(), a.dtype = DType::f32, a.shape = {n - 1, H}, a.strides = {H, 1};
            score.alibi_slopes = a;
        }
        if (score_mods & FA_SCORE_SINKS) {
            sinks.assign(size_t(H), 0.25f);
            TensorView t;
            t.data = sinks.data(), t.dtype = DType::f32, t.shape = {H}, t.strides = {1};
            score.sinks = t;
        }
        ScoreInputs unused;
        call = make_varlen("test", seqs, view3(q, tq, H), view3(k, tk, Hkv), view3(v, tk, Hkv),
                           options, score, unused);
    }
};

}  // namespace

int main() {
    // The lane probe: the kernels' layout passes; column pairs swapped fail,
    // naming the lane.
    CHECK(sim_lane_probe().empty());
    fa_sim::set_lane_map_fault(true);
    const std::string lane_error = sim_lane_probe();
    fa_sim::set_lane_map_fault(false);
    CHECK(lane_error.find("simdgroup_load: lane 0 element 0 holds 3") != std::string::npos);
    {
        std::vector<float> out(kLaneProbeOutputs, 0.0f);
        CHECK(!check_lane_probe(out.data()).empty());
    }

    // Every pipeline any plan has is reached by a probe call: checked with the
    // cpu engine answering for itself (every probe passes), over the gate's
    // grid of shapes, head sizes, dtypes and score options.
    {
        std::unique_ptr<Engine> cpu = make_cpu_engine();
        SelfTest test("cpu", GpuInfo{}, [&]() -> Engine& { return *cpu; });
        const int lengths[][2] = {{1, 4096}, {3, 700}, {32, 40}, {113, 203}};
        const int heads[][2] = {{1, 1}, {4, 1}, {8, 2}, {3, 3}};
        const int mods[] = {0, FA_SCORE_SOFTCAP | FA_SCORE_ALIBI | FA_SCORE_MASK_BOOL | FA_SCORE_SINKS,
                            FA_SCORE_MASK_FLOAT};
        for (int D : {8, 32, 59, 64, 96, 128, 200, 256})
            for (DType dt : {DType::f32, DType::f16, DType::bf16})
                for (int m : mods)
                    for (const auto& t : lengths)
                        for (const auto& h : heads) {
                            const FlashParams p = shape(1, t[0], t[1], h[0], h[1], D, m);
                            try {
                                test.check_forward(*cpu, p, dt);
                                test.check_backward(*cpu, p, dt);
                            } catch (const SelfTestFailed& e) {
                                std::printf("%s\n", e.what());
                                CHECK(false);
                            }
                        }
        CHECK(test.failure().empty());
        const SelfTest::Stats st = test.stats();
        std::printf("coverage: %d pipelines reached by %d probe calls (%.2f s on the cpu engine)\n",
                    st.pipelines, st.probes, st.seconds);
        CHECK(st.pipelines > 100);
        // One-launch varlen calls plan the varlen pipelines (FA_FC_VARLEN):
        // the varlen probes reach each of them, decode batches (a query or
        // none per sequence: MHA's vector kernel) included.
        const int dense = st.pipelines;
        const int varlen_mods[] = {0, FA_SCORE_SOFTCAP | FA_SCORE_ALIBI | FA_SCORE_SINKS};
        const std::vector<int> varlen_q[] = {{1, 300, 0, 17}, {1, 1, 0, 1}};
        for (int D : {8, 64, 96, 128, 256})
            for (DType dt : {DType::f32, DType::f16, DType::bf16})
                for (int m : varlen_mods)
                    for (const auto& h : heads)
                        for (const std::vector<int>& lens_q : varlen_q) {
                            const VarlenCall v(lens_q, {700, 300, 5, 0}, h[0], h[1], D, m);
                            try {
                                test.check_forward_varlen(*cpu, v.call, dt);
                                test.check_backward_varlen(*cpu, v.call, dt);
                            } catch (const SelfTestFailed& e) {
                                std::printf("%s\n", e.what());
                                CHECK(false);
                            }
                        }
        CHECK(test.failure().empty());
        std::printf("varlen coverage: %d more pipelines\n", test.stats().pipelines - dense);
        CHECK(test.stats().pipelines > dense + 30);
    }

    // On metal-sim (FLASHATTN_METAL_SELFTEST=1 turns it on there): calls pass,
    // each new pipeline tested once.
    setenv("FLASHATTN_METAL_SELFTEST", "1", 1);
    {
        std::unique_ptr<Engine> sim = make_metal_sim_engine();
        CHECK(sim->selftest() != nullptr);
        const FlashParams p = shape(1, 40, 40, 2, 1, 64);
        sim->selftest()->check_forward(*sim, p, DType::f32);
        const int after_first = sim->selftest()->stats().pipelines;
        CHECK(after_first >= 1);
        sim->selftest()->check_forward(*sim, shape(2, 33, 50, 2, 1, 64), DType::f32);
        CHECK(sim->selftest()->stats().pipelines == after_first);  // the same pipeline: not again
        sim->selftest()->check_backward(*sim, p, DType::bf16);
        CHECK(sim->selftest()->stats().pipelines > after_first);
        // A varlen call: its pipelines are new, tested by the varlen probe.
        const int dense = sim->selftest()->stats().pipelines;
        const VarlenCall v({5, 0, 40}, {9, 3, 40}, 2, 1, 64);
        sim->selftest()->check_forward_varlen(*sim, v.call, DType::f32);
        CHECK(sim->selftest()->stats().pipelines == dense + 1);
        sim->selftest()->check_backward_varlen(*sim, v.call, DType::f16);
        CHECK(sim->selftest()->stats().pipelines > dense + 1);
        CHECK(sim->unusable_reason().empty());
        const SelfTest::Stats st = sim->selftest()->stats();
        std::printf("metal-sim: %d pipelines, %d probe calls, %.2f s\n", st.pipelines, st.probes,
                    st.seconds);
    }
    // A planted wrong lane map: the engine does not start (the lane probe) ...
    fa_sim::set_lane_map_fault(true);
    CHECK_THROWS(std::runtime_error, "metal-sim engine self-test failed: lane probe",
                 make_metal_sim_engine());
    // ... and a started engine's first call fails its known-answer test,
    // which leaves the engine out, naming the pipeline.
    fa_sim::set_lane_map_fault(false);
    {
        std::unique_ptr<Engine> sim = make_metal_sim_engine();
        fa_sim::set_lane_map_fault(true);
        SelfTest* test = sim->selftest();
        CHECK_THROWS(SelfTestFailed, "pipeline 'flash_fwd_f32_hd64",
                     test->check_forward(*sim, shape(1, 40, 40, 2, 1, 64), DType::f32));
        CHECK(sim->unusable_reason().find("metal-sim engine self-test failed") == 0);
        // Every later call is refused with the same reason.
        CHECK_THROWS(SelfTestFailed, "flash_fwd_f32_hd64",
                     test->check_forward(*sim, shape(1, 5, 5, 1, 1, 8), DType::f32));
        fa_sim::set_lane_map_fault(false);
    }
    // ... and so does a varlen call's, through the varlen probe.
    {
        std::unique_ptr<Engine> sim = make_metal_sim_engine();
        fa_sim::set_lane_map_fault(true);
        const VarlenCall v({5, 0, 40}, {9, 3, 40}, 2, 1, 64);
        CHECK_THROWS(SelfTestFailed, "(forward of the varlen probe call",
                     sim->selftest()->check_forward_varlen(*sim, v.call, DType::f32));
        CHECK(sim->unusable_reason().find("sequences of 37x45, 1x30, 0x6, 12x0") != std::string::npos);
        fa_sim::set_lane_map_fault(false);
    }
    // The switch: 0 turns it off, anything but 0 or 1 is refused.
    setenv("FLASHATTN_METAL_SELFTEST", "0", 1);
    CHECK(make_metal_sim_engine()->selftest() == nullptr);
    setenv("FLASHATTN_METAL_SELFTEST", "yes", 1);
    CHECK_THROWS(std::invalid_argument, "FLASHATTN_METAL_SELFTEST must be 0 (off) or 1 (on), got 'yes'",
                 make_metal_sim_engine());
    unsetenv("FLASHATTN_METAL_SELFTEST");
    return flashattn_test::finish("test_selftest");
}
