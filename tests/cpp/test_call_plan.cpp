// The in-stream paths' plan of a call (core/call_plan.h, which
// flashattn._core._plan_call hands to Python) is the metal engine's: for
// the same arrays, what the metal host's steps (metal/staging.h:
// run_staged_forward / run_staged_backward, as cpp/metal/engine.mm runs
// them) give their execute callback, the same FlashParams and
// FlashScoreParams bytes, launches, scratch, and schedule of pieces and
// command buffers (FLASHATTN_MAX_GROUPS_PER_PIECE included). Arrays in the
// pool and wrapped host memory keep their strides, as MLX's and torch's
// buffers keep theirs in-stream.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "core/call_plan.h"
#include "core/score_arrays.h"
#include "metal/staging.h"
#include "metal_host_backend.h"

using namespace flashattn;
using namespace flashattn::metal;
using namespace flashattn_test;

namespace {

struct Staged {
    Plan plan;
    Schedule schedule;
};

bool same_launch(const Launch& a, const Launch& b) {
    if (a.kernel != b.kernel || a.buffers != b.buffers || a.constants.size() != b.constants.size())
        return false;
    for (size_t i = 0; i < a.constants.size(); ++i)
        if (a.constants[i].index != b.constants[i].index || a.constants[i].type != b.constants[i].type ||
            a.constants[i].bits != b.constants[i].bits)
            return false;
    auto same = [](const Dim3& x, const Dim3& y) { return x.x == y.x && x.y == y.y && x.z == y.z; };
    return same(a.grid, b.grid) && same(a.threadgroup, b.threadgroup);
}

void check_same(const CallPlan& ours, const Staged& host, const std::string& label) {
    std::printf("  %s: %zu launches, %zu pieces, %zu command buffers\n", label.c_str(),
                host.plan.launches.size(), host.schedule.pieces.size(),
                host.schedule.command_buffers.size());
    CHECK(!ours.empty);
    CHECK(std::memcmp(&ours.plan.params, &host.plan.params, sizeof(FlashParams)) == 0);
    CHECK(std::memcmp(&ours.params, &host.plan.params, sizeof(FlashParams)) == 0);
    CHECK(std::memcmp(&ours.plan.score, &host.plan.score, sizeof(FlashScoreParams)) == 0);
    CHECK(ours.plan.launches.size() == host.plan.launches.size());
    for (size_t i = 0; i < ours.plan.launches.size() && i < host.plan.launches.size(); ++i)
        CHECK(same_launch(ours.plan.launches[i], host.plan.launches[i]));
    CHECK(ours.plan.scratch.size() == host.plan.scratch.size());
    for (size_t i = 0; i < ours.plan.scratch.size() && i < host.plan.scratch.size(); ++i)
        CHECK(ours.plan.scratch[i].slot == host.plan.scratch[i].slot &&
              ours.plan.scratch[i].floats == host.plan.scratch[i].floats);
    CHECK(ours.schedule.command_buffers == host.schedule.command_buffers);
    CHECK(ours.schedule.pieces.size() == host.schedule.pieces.size());
    for (size_t i = 0; i < ours.schedule.pieces.size() && i < host.schedule.pieces.size(); ++i) {
        const Piece& a = ours.schedule.pieces[i];
        const Piece& b = host.schedule.pieces[i];
        CHECK(a.launch == b.launch && a.origin.x == b.origin.x && a.origin.y == b.origin.y &&
              a.origin.z == b.origin.z && a.grid.x == b.grid.x && a.grid.y == b.grid.y &&
              a.grid.z == b.grid.z);
    }
}

struct Call {
    const char* name;
    int B, Tq, Tk, H, Hkv, D;
    bool causal;
    DType dtype;
    bool packed;     // q, k, v as slices of one (B, T, 3, H, D) buffer (Tq == Tk, H == Hkv)
    bool options;    // softcap, (H,) slopes, a (Tq, Tk) bool mask broadcast, sinks
};

void run(const Call& c, const GpuInfo& gpu) {
    HostBackend backend;
    backend.can_wrap = true;
    auto pool = HostPool::create(backend, kPage, size_t(1) << 30);
    std::vector<std::shared_ptr<void>> keep;
    const size_t es = dtype_size(c.dtype);
    auto buffer = [&](size_t bytes) {
        auto lease = pool->acquire(bytes > 0 ? bytes : 1);
        std::memset(lease->data, 0, bytes);
        keep.push_back(lease);
        return lease->data;
    };
    const int64_t nq = int64_t(c.B) * c.Tq * c.H * c.D, nkv = int64_t(c.B) * c.Tk * c.Hkv * c.D;
    auto view = [&](const void* d, int64_t T, int64_t H, std::vector<int64_t> strides) {
        return TensorView{d, {c.B, T, H, c.D}, strides, c.dtype};
    };
    TensorView q, k, v;
    if (c.packed) {
        char* qkv = static_cast<char*>(buffer(size_t(3 * nq) * es));
        const std::vector<int64_t> s = {int64_t(c.Tq) * 3 * c.H * c.D, 3 * c.H * c.D, c.D, 1};
        q = view(qkv, c.Tq, c.H, s);
        k = view(qkv + c.H * c.D * es, c.Tk, c.Hkv, s);
        v = view(qkv + 2 * c.H * c.D * es, c.Tk, c.Hkv, s);
    } else {
        q = view(buffer(size_t(nq) * es), c.Tq, c.H, {int64_t(c.Tq) * c.H * c.D, c.H * c.D, c.D, 1});
        k = view(buffer(size_t(nkv) * es), c.Tk, c.Hkv, {int64_t(c.Tk) * c.Hkv * c.D, c.Hkv * c.D, c.D, 1});
        v = view(buffer(size_t(nkv) * es), c.Tk, c.Hkv, {int64_t(c.Tk) * c.Hkv * c.D, c.Hkv * c.D, c.D, 1});
    }
    AttentionOptions opt;
    opt.causal = c.causal;
    ScoreOptions so;
    if (c.options) {
        so.softcap = 7.0;
        so.alibi_slopes = TensorView{buffer(size_t(c.H) * 4), {c.B, c.H}, {0, 1}};
        so.mask = TensorView{buffer(size_t(c.Tq) * c.Tk), {c.B, c.H, c.Tq, c.Tk}, {0, 0, c.Tk, 1}};
        so.mask_is_bool = true;
        so.sinks = TensorView{buffer(size_t(c.H) * 4), {c.H}, {1}};
    }

    // Forward: ours, then the metal host's steps.
    const CallPlan ours = plan_call_forward(q, k, v, opt, so, c.dtype, gpu);
    FlashParams p = make_forward_params(q, k, v, opt);
    ForwardIO io{q.data, k.data, v.data, buffer(size_t(nq) * es),
                 static_cast<float*>(buffer(size_t(c.B) * c.H * c.Tq * 4)),
                 make_score_inputs("attention", p, so)};
    io.dtype = c.dtype;
    Staged host;
    run_staged_forward(*pool, p, io, gpu, [&](const Plan& plan, const CallBuffers<HostPool>&) {
        host.plan = plan;
        host.schedule = schedule_plan(plan, work_model_from_env());
    });
    check_same(ours, host, std::string(c.name) + " forward, " + std::to_string(gpu.cores) + " cores");

    // Backward, with o and lse from the forward's outputs.
    const TensorView dout = view(buffer(size_t(nq) * es), c.Tq, c.H,
                                 {int64_t(c.Tq) * c.H * c.D, c.H * c.D, c.D, 1});
    const TensorView o = view(io.o, c.Tq, c.H, {int64_t(c.Tq) * c.H * c.D, c.H * c.D, c.D, 1});
    const TensorView lse{io.lse, {c.B, c.H, c.Tq}, {int64_t(c.H) * c.Tq, c.Tq, 1}, DType::f32};
    const CallPlan ours_b = plan_call_backward(dout, q, k, v, o, lse, opt, so, c.dtype);
    FlashParams pb = make_backward_params(dout, q, k, v, o, lse, opt);
    BackwardIO bio{dout.data, q.data, k.data, v.data, o.data, io.lse, buffer(size_t(nq) * es),
                   buffer(size_t(nkv) * es), buffer(size_t(nkv) * es),
                   make_score_inputs("attention_backward", pb, so)};
    bio.dtype = c.dtype;
    Staged host_b;
    run_staged_backward(*pool, pb, bio, [&](const Plan& plan, const CallBuffers<HostPool>&) {
        host_b.plan = plan;
        host_b.schedule = schedule_plan(plan, work_model_from_env());
    });
    check_same(ours_b, host_b, std::string(c.name) + " backward");
}

}  // namespace

int main() {
    const Call calls[] = {
        {"gqa causal f32", 2, 37, 50, 4, 2, 16, true, DType::f32, false, false},
        {"packed qkv f16", 2, 33, 33, 4, 4, 64, false, DType::f16, true, false},
        {"options bf16", 1, 29, 41, 6, 3, 100, true, DType::bf16, false, true},
        {"decode split-KV f32", 3, 1, 3000, 8, 2, 128, false, DType::f32, false, false},
        {"hd256 chunks f16", 1, 70, 70, 2, 1, 256, true, DType::f16, false, true},
        // Past one command buffer's share of the watchdog model (core/chunks.h).
        {"watchdog pieces f16", 1, 8192, 8192, 8, 8, 64, false, DType::f16, false, false},
    };
    // The smallest Apple GPU (an 8-core M1, the default) and a 40-core Max:
    // the in-stream plan is told the cores the metal engine reads.
    const GpuInfo m1{}, max40{40};
    for (const GpuInfo& gpu : {m1, max40})
        for (const Call& c : calls) run(c, gpu);
    // Cut into pieces, each in a command buffer of its own, on both sides.
    setenv("FLASHATTN_MAX_GROUPS_PER_PIECE", "3", 1);
    for (const Call& c : calls) run(c, m1);
    unsetenv("FLASHATTN_MAX_GROUPS_PER_PIECE");
    {   // ... and the core count matters: decode splits the keys over more
        // threadgroups on the larger GPU (8 kv heads: 8 splits fill an
        // M1's 8 x kGroupsPerCore, a Max's take the most, FA_MAX_KV_SPLITS).
        const TensorView q{nullptr, {1, 1, 8, 128}, {1024, 1024, 128, 1}},
            k{nullptr, {1, 32768, 8, 128}, {32768 * 1024, 1024, 128, 1}};
        const int32_t small = plan_call_forward(q, k, k, {}, {}, DType::f32, m1).params.kv_splits;
        const int32_t large = plan_call_forward(q, k, k, {}, {}, DType::f32, max40).params.kv_splits;
        std::printf("  decode 1 x 32768 keys: kv_splits %d on 8 cores, %d on 40\n", small, large);
        CHECK(large > small);
    }
    // An empty call plans nothing (the hosts answer it as run_forward does).
    const TensorView q{nullptr, {1, 4, 2, 8}, {64, 16, 8, 1}}, k{nullptr, {1, 0, 2, 8}, {0, 16, 8, 1}};
    CHECK(plan_call_forward(q, k, k, {}, {}, DType::f32).empty);
    return finish("test_call_plan");
}
