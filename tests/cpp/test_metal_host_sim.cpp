// The metal engine's host steps for a call (metal/staging.h: run_staged_*,
// which cpp/metal/engine.mm runs) over a host-memory pool, with metal-sim
// executing the plan where the GPU would: the score options' arrays staged
// (in place, wrapped, copied as their span, or copied compactly with their
// broadcast axes kept), the plan built from the staged strides and values,
// every [[buffer(n)]] taken from CallBuffers::buffer_for as device.mm takes
// it. Each call must give the bits of the metal-sim engine, which binds the
// same arrays in place; and the transfer counters must show each array
// cost the memory it spans or holds, never B·H·Tq·Tk.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "core/engine.h"
#include "core/half.h"
#include "core/params.h"
#include "core/score_arrays.h"
#include "core/varlen.h"
#include "engines/factories.h"
#include "metal/staging.h"
#include "metal_host_backend.h"
#include "sim/launcher.h"

using namespace flashattn;
using namespace flashattn::metal;
using namespace flashattn_test;

namespace {

using HostCall = CallBuffers<HostPool>;

// The executor's dedicated buffer for slots a call does not use, as
// device.mm's Device holds one (staging.h, Binding::unused): 16 bytes of
// 0xff here, unlike the metal-sim engine's (four NaNs), so that a kernel
// reading it would give other bits than that engine (a bool mask read as
// all true there, partly false here) or non-finite outputs (a float read).
alignas(16) unsigned char g_unused_slot[kUnusedSlotBytes];
int g_unused_bound = 0;  // slots bound to it, over the plan's launches

// Binds each slot as device.mm's encoder does (buffer_for), then has
// metal-sim run the plan (which allocates the plan's scratch itself).
void execute_on_sim(const Plan& plan, const HostCall& call) {
    sim::SlotPointers slots{};
    std::array<bool, kSlotCount> seen{};
    for (const Launch& launch : plan.launches)
        for (size_t i = 0; i < launch.buffers.size(); ++i) {
            const Slot s = launch.buffers[i];
            if (s == Slot::params || s == Slot::score) continue;
            const HostCall::Binding& b = call.buffer_for(launch, i);
            // Only a score option the call does not have is unused, and the
            // varlen sequences' table of a dense call.
            const bool optional = is_score_slot(s) && !score_slot_used(s, plan.params.score_mods);
            CHECK(b.unused == (optional && !(s == Slot::seqs && call.binding(s).bound)));
            CHECK(b.unused != b.bound);
            if (b.unused && s != Slot::seqs) ++g_unused_bound;
            void* ptr = b.unused ? static_cast<void*>(g_unused_slot)
                                 : static_cast<char*>(b.handle->data) + b.offset;
            CHECK(!seen[size_t(s)] || slots[size_t(s)] == ptr);  // one buffer per slot and call
            slots[size_t(s)] = ptr;
            seen[size_t(s)] = true;
        }
    sim::run_plan(plan, slots);
}

// The metal engine with metal-sim for a GPU: its outputs are pool buffers.
class HostOnSim final : public Engine {
public:
    explicit HostOnSim(bool can_wrap) {
        HostBackend backend;
        backend.can_wrap = can_wrap;
        pool = HostPool::create(backend, kPage, size_t(1) << 30);
    }
    std::string name() const override { return "metal host on metal-sim"; }
    int score_mods_supported(bool) const override { return kEveryScoreMod; }
    bool dtype_supported(DType) const override { return true; }  // as the metal engine
    OutputBuffer allocate(size_t bytes) override {
        auto lease = pool->acquire(bytes);
        return {lease->data, lease};
    }
    // n float32s in the pool.
    float* floats(size_t n, std::vector<OutputBuffer>& keep) {
        keep.push_back(allocate(n * sizeof(float)));
        return static_cast<float*>(keep.back().data);
    }
    void forward(const FlashParams& p, const ForwardIO& io) override {
        last = run_staged_forward(*pool, p, io, GpuInfo{}, execute_on_sim);
    }
    void backward(const FlashParams& p, const BackwardIO& io) override {
        last = run_staged_backward(*pool, p, io, execute_on_sim);
    }
    // A varlen batch as engine.mm runs it: counting the plans the device
    // would execute and their launches.
    void forward_varlen(const Varlen& call, const ForwardIO& io) override {
        last = run_staged_forward_varlen(*pool, call, io, GpuInfo{}, counted());
    }
    void backward_varlen(const Varlen& call, const BackwardIO& io) override {
        last = run_staged_backward_varlen(*pool, call, io, counted());
    }
    std::shared_ptr<HostPool> pool;
    TransferStats last;
    int executes = 0;
    size_t launches = 0;

private:
    std::function<void(const Plan&, const HostCall&)> counted() {
        return [this](const Plan& plan, const HostCall& call) {
            ++executes;
            launches += plan.launches.size();
            execute_on_sim(plan, call);
        };
    }
};

// A mask's memory and the view of it the call passes.
struct MaskCase {
    std::string name;
    bool is_bool;
    std::vector<int64_t> strides;  // of the (B, H, Tq, Tk) view, in elements
    int64_t offset;                // of element [0, 0, 0, 0] in the memory, in elements
    int64_t elements;              // of the memory
    enum Where { host, pool_buffer, page_aligned } where;
    // Bytes the staging may copy or wrap: its span or, compactly, what it holds.
    int64_t expect_bytes;
    bool expect_compact;
};

struct Shape {
    int B, Tq, Tk, H, Hkv, D;
    bool causal;
};

std::vector<float> random_vector(size_t n, std::mt19937& rng) {
    std::normal_distribution<float> dist;
    std::vector<float> x(n);
    for (float& e : x) e = dist(rng);
    return x;
}

bool same_bits(const void* a, const void* b, size_t bytes) {
    return std::memcmp(a, b, bytes) == 0;
}

int cases_run = 0;

// Forward and backward of one call on both engines; then the mask's path.
void run_case(const Shape& s, const MaskCase* m, int alibi_kind, bool sinks, float softcap,
              bool can_wrap, DType dt = DType::f32) {
    if (!flashattn_test::case_selected()) return;
    static const std::unique_ptr<Engine> sim = make_metal_sim_engine();
    Engine& sim_engine = *sim;
    HostOnSim host(can_wrap);
    std::mt19937 rng(uint32_t(1000 + cases_run));
    const int64_t nq = int64_t(s.B) * s.Tq * s.H * s.D, nkv = int64_t(s.B) * s.Tk * s.Hkv * s.D;
    // q, k, v, do in pool buffers: bound in place, so the counters below count
    // only the score options' arrays.
    std::vector<OutputBuffer> keep;  // the pool buffers of this case
    const size_t es = dtype_size(dt);
    auto in_pool = [&](const std::vector<float>& x) {  // in the call's dtype
        keep.push_back(host.allocate(x.size() * es));
        auto* b = static_cast<unsigned char*>(keep.back().data);
        for (size_t i = 0; i < x.size(); ++i) {
            const uint16_t h = dt == DType::f16 ? from_float<Half>(x[i]).bits
                                                : from_float<BFloat16>(x[i]).bits;
            if (dt == DType::f32) std::memcpy(b + i * 4, &x[i], 4);
            else std::memcpy(b + i * 2, &h, 2);
        }
        return static_cast<const float*>(static_cast<const void*>(b));
    };
    auto out_pool = [&](size_t n) {  // n elements of the call's dtype
        keep.push_back(host.allocate(n * es));
        return static_cast<float*>(keep.back().data);
    };
    const float *q = in_pool(random_vector(size_t(nq), rng)),
                *k = in_pool(random_vector(size_t(nkv), rng)),
                *v = in_pool(random_vector(size_t(nkv), rng)),
                *dout = in_pool(random_vector(size_t(nq), rng));
    auto view4 = [&](const float* d, int64_t B, int64_t T, int64_t H, int64_t D) {
        return TensorView{d, {B, T, H, D}, {T * H * D, H * D, D, 1}, dt};
    };
    AttentionOptions opt;
    opt.causal = s.causal;
    FlashParams p = make_forward_params(view4(q, s.B, s.Tq, s.H, s.D),
                                        view4(k, s.B, s.Tk, s.Hkv, s.D),
                                        view4(v, s.B, s.Tk, s.Hkv, s.D), opt);

    ScoreOptions so;
    so.softcap = softcap;
    // Slopes: (H,) broadcast over B, (B, H), or (B, H) with batch 0 last in memory.
    std::vector<float> slopes(size_t(s.B) * s.H);
    for (float& x : slopes) x = std::uniform_real_distribution<float>(0.02f, 0.3f)(rng);
    if (alibi_kind == 1) so.alibi_slopes = TensorView{slopes.data(), {s.B, s.H}, {0, 1}};
    if (alibi_kind == 2) so.alibi_slopes = TensorView{slopes.data(), {s.B, s.H}, {s.H, 1}};
    if (alibi_kind == 3)
        so.alibi_slopes = TensorView{slopes.data() + (s.B - 1) * s.H, {s.B, s.H}, {-s.H, 1}};
    std::vector<float> sink_logits = random_vector(size_t(s.H), rng);
    sink_logits[0] = 3.0f;
    if (sinks) so.sinks = TensorView{sink_logits.data(), {s.H}, {1}};

    std::vector<unsigned char> host_mask;
    std::shared_ptr<void> aligned_mask;
    if (m) {
        const size_t bytes = size_t(m->elements) * (m->is_bool ? 1 : 4);
        unsigned char* mem = nullptr;
        if (m->where == MaskCase::pool_buffer) {
            mem = reinterpret_cast<unsigned char*>(host.floats((bytes + 3) / 4, keep));
        } else if (m->where == MaskCase::page_aligned) {
            aligned_mask.reset(std::aligned_alloc(kPage, (bytes + kPage - 1) / kPage * kPage), std::free);
            mem = static_cast<unsigned char*>(aligned_mask.get());
        } else {
            host_mask.resize(bytes + 4);
            mem = host_mask.data() + 4;  // 4-byte aligned, never page aligned
        }
        for (int64_t e = 0; e < m->elements; ++e) {
            if (m->is_bool) {
                mem[e] = std::uniform_real_distribution<float>()(rng) < 0.7f;
            } else {
                float x = std::normal_distribution<float>()(rng);
                if (std::uniform_real_distribution<float>()(rng) < 0.2f) x = -INFINITY;
                std::memcpy(mem + e * 4, &x, 4);
            }
        }
        so.mask = TensorView{reinterpret_cast<const float*>(mem + m->offset * (m->is_bool ? 1 : 4)),
                             {s.B, s.H, s.Tq, s.Tk}, m->strides};
        so.mask_is_bool = m->is_bool;
    }
    const ScoreInputs score = make_score_inputs("attention", p, so);
    const std::string label = std::string(m ? m->name : "no mask") + " alibi=" +
                              std::to_string(alibi_kind) + (sinks ? " sinks" : "") +
                              (softcap > 0 ? " softcap" : "") + (can_wrap ? " (wrap)" : "") +
                              " " + dtype_name(dt) +
                              " B=" + std::to_string(s.B) + " Tq=" + std::to_string(s.Tq) +
                              " Tk=" + std::to_string(s.Tk);

    // Forward on both.
    g_unused_bound = 0;
    std::vector<float> o_sim(static_cast<size_t>(nq)), lse_sim(static_cast<size_t>(lse_elements(p)));
    run_forward(sim_engine, p, {q, k, v, o_sim.data(), lse_sim.data(), score, dt});
    float* o = out_pool(size_t(nq));
    float* lse = host.floats(size_t(lse_elements(p)), keep);
    run_forward(host, p, {q, k, v, o, lse, score, dt});
    const TransferStats fwd = host.last;
    const bool fwd_ok = same_bits(o, o_sim.data(), size_t(nq) * es) &&
                        same_bits(lse, lse_sim.data(), lse_sim.size() * sizeof(float));
    CHECK(fwd_ok);

    // Backward on both, from the same forward.
    const TensorView o_view = view4(o, s.B, s.Tq, s.H, s.D);
    const TensorView lse_view{lse, {s.B, s.H, s.Tq}, {int64_t(s.H) * s.Tq, s.Tq, 1}, DType::f32};
    FlashParams pb = make_backward_params(view4(dout, s.B, s.Tq, s.H, s.D),
                                          view4(q, s.B, s.Tq, s.H, s.D),
                                          view4(k, s.B, s.Tk, s.Hkv, s.D),
                                          view4(v, s.B, s.Tk, s.Hkv, s.D), o_view, lse_view, opt);
    const ScoreInputs score_b = make_score_inputs("attention_backward", pb, so);
    std::vector<float> g_sim[3] = {std::vector<float>(size_t(nq)), std::vector<float>(size_t(nkv)),
                                   std::vector<float>(size_t(nkv))};
    std::vector<float> ds_sim(size_t(s.H)), ds_host(size_t(s.H));
    BackwardIO bio{dout, q, k, v, o, lse, g_sim[0].data(), g_sim[1].data(), g_sim[2].data(),
                   score_b};
    bio.dsinks = sinks ? ds_sim.data() : nullptr;
    bio.dtype = dt;
    run_backward(sim_engine, pb, bio);
    float* dq = out_pool(size_t(nq));
    float* dk = out_pool(size_t(nkv));
    float* dv = out_pool(size_t(nkv));
    bio.dq = dq, bio.dk = dk, bio.dv = dv;
    bio.dsinks = sinks ? ds_host.data() : nullptr;
    run_backward(host, pb, bio);
    const TransferStats bwd = host.last;
    const bool bwd_ok = same_bits(dq, g_sim[0].data(), size_t(nq) * es) &&
                        same_bits(dk, g_sim[1].data(), size_t(nkv) * es) &&
                        same_bits(dv, g_sim[2].data(), size_t(nkv) * es) &&
                        same_bits(ds_host.data(), ds_sim.data(), ds_sim.size() * sizeof(float));
    CHECK(bwd_ok);

    // The slots of the options this call lacks went to the dedicated buffer
    // (each launch binds all three score slots), and none of them was read:
    // the bits above match the metal-sim engine's, whose buffer differs, and
    // every float32 output is finite.
    const int unused_options = (alibi_kind == 0) + (!m) + (!sinks);
    CHECK((g_unused_bound > 0) == (unused_options > 0));
    if (dt == DType::f32) {
        bool finite = true;
        for (const float* a : {static_cast<const float*>(o), static_cast<const float*>(dq),
                               static_cast<const float*>(dk), static_cast<const float*>(dv)}) {
            const size_t n = size_t(a == o || a == dq ? nq : nkv);
            for (size_t i = 0; i < n; ++i) finite = finite && std::isfinite(a[i]);
        }
        CHECK(finite);
    }

    // What crossed: every array but the score options' is a pool buffer.
    // Slopes: 4 H bytes broadcast, 4 B H otherwise; sinks 4 H.
    int64_t copied = 0, wrapped = 0, copies = 0, wraps = 0, in_place = 0;
    auto expect = [&](int64_t bytes, bool compact, bool in_pool_buffer) {
        if (in_pool_buffer) in_place += 1;
        else if (can_wrap && !compact) wraps += 1, wrapped += bytes;
        else copies += 1, copied += bytes;
    };
    if (alibi_kind) expect(4 * (alibi_kind == 1 ? s.H : int64_t(s.B) * s.H), alibi_kind == 3, false);
    if (sinks) expect(4 * s.H, false, false);
    if (m) expect(m->expect_bytes, m->expect_compact, m->where == MaskCase::pool_buffer);
    for (const TransferStats* t : {&fwd, &bwd}) {
        const bool counts_ok = int64_t(t->input_copies) == copies &&
                               int64_t(t->input_copy_bytes) == copied &&
                               int64_t(t->inputs_no_copy) == wraps &&
                               int64_t(t->inputs_no_copy_bytes) >= wrapped &&  // whole pages
                               int64_t(t->inputs_in_place) ==
                                   in_place + (t == &fwd ? 3 : 6) &&  // q k v (+ do o lse)
                               t->output_copies == 0;
        CHECK(counts_ok);
        if (!counts_ok)
            std::printf("  %s: copies %llu (%llu bytes), wraps %llu, in place %llu; want %lld (%lld "
                        "bytes), %lld, %lld + inputs\n",
                        label.c_str(), (unsigned long long)t->input_copies,
                        (unsigned long long)t->input_copy_bytes,
                        (unsigned long long)t->inputs_no_copy,
                        (unsigned long long)t->inputs_in_place, (long long)copies,
                        (long long)copied, (long long)wraps, (long long)in_place);
    }
    std::printf("  %s  %s\n", fwd_ok && bwd_ok ? "ok " : "BAD", label.c_str());
    ++cases_run;
}

}  // namespace

// A variable-length batch (issue 34) through the metal host: one plan
// executed, with the launches of a dense call (1 forward, 3 backward)
// whatever the number of sequences, and the bits of the per-sequence calls
// (Engine's default forward_varlen on the metal-sim engine: one ordinary
// call per sequence) -- empty sequences, queries without keys included.
void run_varlen_case(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k,
                     bool causal, int64_t window, bool alibi_sinks, bool split_alone = false) {
    if (!flashattn_test::case_selected()) return;
    const int64_t H = 4, Hkv = 2, D = 48, n = int64_t(lens_q.size());
    std::vector<int32_t> cu_q(1, 0), cu_k(1, 0);
    for (int64_t b = 0; b < n; ++b) {
        cu_q.push_back(cu_q.back() + lens_q[size_t(b)]);
        cu_k.push_back(cu_k.back() + lens_k[size_t(b)]);
    }
    const int64_t tq = cu_q.back(), tk = cu_k.back();
    std::mt19937 rng(34);
    const std::vector<float> q = random_vector(size_t(tq * H * D), rng);
    const std::vector<float> k = random_vector(size_t(tk * Hkv * D), rng);
    const std::vector<float> v = random_vector(size_t(tk * Hkv * D), rng);
    const std::vector<float> dout = random_vector(size_t(tq * H * D), rng);
    const std::vector<float> slopes = random_vector(size_t(n * H), rng);
    const std::vector<float> sinks = random_vector(size_t(H), rng);
    auto view = [](const float* p, int64_t rows, int64_t heads, int64_t d) {
        return TensorView{p, {rows, heads, d}, {heads * d, d, 1}};
    };
    const Sequences seqs = make_sequences("varlen test", cu_q.data(), n + 1, cu_k.data(), n + 1, tq, tk);
    AttentionOptions options;
    options.causal = causal;
    options.window_left = window;
    ScoreOptions score;
    if (alibi_sinks) {
        score.softcap = 4.0;
        score.alibi_slopes = TensorView{slopes.data(), {n, H}, {H, 1}};
        score.sinks = TensorView{sinks.data(), {H}, {1}};
    }
    HostOnSim host(true);
    std::unique_ptr<Engine> sim = make_metal_sim_engine();
    std::vector<float> o1(size_t(tq * H * D)), o2(o1.size()), lse1(size_t(H * tq)), lse2(lse1.size());
    run_forward_varlen(host, seqs, view(q.data(), tq, H, D), view(k.data(), tk, Hkv, D),
                       view(v.data(), tk, Hkv, D), options, score, o1.data(), lse1.data());
    CHECK(host.executes == 1 && host.launches == 1);
    run_forward_varlen(*sim, seqs, view(q.data(), tq, H, D), view(k.data(), tk, Hkv, D),
                       view(v.data(), tk, Hkv, D), options, score, o2.data(), lse2.data(),
                       VarlenSchedule::per_sequence);
    if (!split_alone) {
        CHECK(same_bits(o1.data(), o2.data(), o1.size() * 4));
        CHECK(same_bits(lse1.data(), lse2.data(), lse1.size() * 4));
    } else {  // alone, each sequence split its keys: a merge's roundings apart
        auto close = [](const std::vector<float>& a, const std::vector<float>& b) {
            double worst = 0, scale = 1;
            for (size_t i = 0; i < a.size(); ++i) {
                worst = std::max(worst, double(std::fabs(a[i] - b[i])));
                scale = std::max(scale, double(std::fabs(b[i])));
            }
            return worst <= 1e-5 * scale;
        };
        CHECK(close(o1, o2));
        CHECK(close(lse1, lse2));
    }

    // NaN first: every row must be written (the call clears none first).
    std::vector<float> g1(size_t((tq + 2 * tk) * H * D), std::numeric_limits<float>::quiet_NaN()),
        g2(g1);
    float ds1[4] = {0}, ds2[4] = {0};
    auto grads = [&](std::vector<float>& g, float* ds, Engine& e, VarlenSchedule sched) {
        run_backward_varlen(e, seqs, view(dout.data(), tq, H, D), view(q.data(), tq, H, D),
                            view(k.data(), tk, Hkv, D), view(v.data(), tk, Hkv, D),
                            view(o1.data(), tq, H, D), lse1.data(), options, score, g.data(),
                            g.data() + tq * H * D, g.data() + tq * H * D + tk * Hkv * D,
                            alibi_sinks ? ds : nullptr, sched);
    };
    grads(g1, ds1, host, VarlenSchedule::one_call);
    CHECK(host.executes == 2 && host.launches == 1 + 3);
    grads(g2, ds2, *sim, VarlenSchedule::per_sequence);
    const size_t used = size_t((tq * H + 2 * tk * Hkv) * D);
    CHECK(same_bits(g1.data(), g2.data(), used * 4));
    CHECK(std::all_of(g1.begin(), g1.begin() + std::ptrdiff_t(used),
                      [](float x) { return std::isfinite(x); }));
    CHECK(same_bits(ds1, ds2, sizeof ds1));
    ++cases_run;
}

int main() {
    std::memset(g_unused_slot, 0xff, sizeof g_unused_slot);
    const Shape s{2, 37, 45, 4, 2, 32, true};
    const int64_t B = s.B, H = s.H, Tq = s.Tq, Tk = s.Tk;
    const int64_t dense = B * H * Tq * Tk;
    const std::vector<MaskCase> masks = {
        // (Tk,) broadcast to (B, H, Tq, Tk): its Tk bytes, not B H Tq Tk.
        {"bool (Tk,)", true, {0, 0, 0, 1}, 0, Tk, MaskCase::host, Tk, false},
        // (B, 1, Tq, 1) float: the B Tq values it holds.
        {"float (B,1,Tq,1)", false, {Tq, 0, 1, 0}, 0, B * Tq, MaskCase::host, 4 * B * Tq, false},
        // A transposed (Tk, Tq) bool array: strides kept, its span.
        {"bool transposed", true, {0, 0, 1, Tq}, 0, Tq * Tk, MaskCase::host, Tq * Tk, false},
        // Keys reversed: a negative stride, copied compactly (keys forward).
        {"float keys reversed", false, {0, 0, Tk, -1}, Tk - 1, Tq * Tk, MaskCase::host,
         4 * Tq * Tk, true},
        // Every other column of a (Tq, 2 Tk) array: gaps, copied compactly.
        {"bool every other key", true, {0, 0, 2 * Tk, 2}, 0, 2 * Tq * Tk, MaskCase::host,
         Tq * Tk, true},
        // Dense, batches in reverse order: compactly, all of it (what it holds).
        {"bool dense batches reversed", true, {-H * Tq * Tk, Tq * Tk, Tk, 1}, (B - 1) * H * Tq * Tk,
         dense, MaskCase::host, dense, true},
        // Dense float in a pool buffer: bound in place.
        {"float dense in the pool", false, {H * Tq * Tk, Tq * Tk, Tk, 1}, 0, dense,
         MaskCase::pool_buffer, 4 * dense, false},
        // (Tq, Tk) float at a page boundary: wrapped without a copy when the backend can.
        {"float (Tq,Tk) page aligned", false, {0, 0, Tk, 1}, 0, Tq * Tk, MaskCase::page_aligned,
         4 * Tq * Tk, false},
    };
    // No option at all: the score slots are bound to the dedicated buffer.
    run_case(s, nullptr, 0, false, 0.0f, false);
    for (size_t i = 0; i < masks.size(); ++i) {
        const int alibi = int(i % 4);
        run_case(s, &masks[i], alibi, i % 2 == 0, i % 3 == 0 ? 5.0f : 0.0f, false);
        if (masks[i].where == MaskCase::page_aligned || i == 2)
            run_case(s, &masks[i], alibi, true, 0.0f, true);
    }
    // Options without a mask, and split-KV decode (a merge launch after the
    // forward: the score slots of one launch only).
    run_case(s, nullptr, 3, true, 2.5f, false);
    const Shape decode{1, 1, 600, 4, 1, 64, false};
    const MaskCase decode_mask{"bool (Tk,) decode", true, {0, 0, 0, 1}, 0, 600, MaskCase::host, 600, false};
    run_case(decode, &decode_mask, 2, true, 30.0f, false);
    run_case(decode, &decode_mask, 1, true, 0.0f, true);
    // float16 and bfloat16 calls: q, k, v, o and the gradients of 2 bytes
    // staged beside float32 score arrays.
    run_case(s, &masks[1], 2, true, 5.0f, false, DType::f16);
    run_case(s, &masks[3], 3, true, 0.0f, true, DType::bf16);
    run_case(decode, &decode_mask, 1, true, 30.0f, false, DType::bf16);
    // Varlen in one plan: mixed lengths, an empty sequence, queries without
    // keys, decode rows against long keys (alone each would split its keys);
    // 1 and 40 sequences give the same launch count.
    run_varlen_case({7, 1, 40, 0, 13, 3}, {7, 30, 40, 5, 2, 0}, true, -1, false);
    run_varlen_case({7, 1, 40, 0, 13, 3}, {7, 30, 40, 5, 2, 0}, false, 9, true);
    run_varlen_case({1, 1, 2, 1}, {600, 520, 700, 64}, false, -1, true, true);
    run_varlen_case({65}, {130}, true, -1, false);
    std::vector<int32_t> many_q, many_k;
    for (int i = 0; i < 40; ++i) many_q.push_back(1 + (i * 7) % 23), many_k.push_back(1 + (i * 11) % 29);
    run_varlen_case(many_q, many_k, true, -1, false);
    std::printf("%d cases\n", cases_run);
    return flashattn_test::finish("test_metal_host_sim");
}
