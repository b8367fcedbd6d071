// The metal engine on a real GPU (Apple only): forward and backward against
// the cpu engine on awkward shapes, host arrays (one copy each) versus pool
// arrays (in place), the score options, float16 and bfloat16 kernels
// against the float32 ones on the same rounded inputs, determinism,
// concurrent calls, and the error that lists the metallib paths tried.
// Exits 77 (ctest: skipped) on a Mac without a
// Metal device or with one the kernels cannot run on (it prints the family).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "core/engine.h"
#include "core/half.h"
#include "core/params.h"
#include "engines/factories.h"
#include "metal/metal_engine.h"

using namespace flashattn;

namespace {

struct Case {
    int B, Tq, Tk, H, Hkv, D;
    bool causal;
    int64_t left, right;
};

std::vector<float> random_vector(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist;
    std::vector<float> x(n);
    for (float& e : x) e = dist(rng);
    return x;
}

TensorView view(const float* data, int64_t B, int64_t T, int64_t H, int64_t D) {
    return TensorView{data, {B, T, H, D}, {T * H * D, H * D, D, 1}};
}

// Max |a - b| / (1 + |b|): a relative error that tolerates values near zero.
double max_err(const float* a, const float* b, size_t n) {
    double e = 0;
    for (size_t i = 0; i < n; ++i) {
        if (std::isinf(a[i]) || std::isinf(b[i])) {
            if (a[i] != b[i]) return INFINITY;
            continue;
        }
        e = std::max(e, std::abs(double(a[i]) - b[i]) / (1.0 + std::abs(double(b[i]))));
    }
    return e;
}

// Copies `host` into a fresh pool buffer of the engine, as fa.asarray does.
// An output buffer's memory as the float32 it holds here.
float* floats(const OutputBuffer& b) { return static_cast<float*>(b.data); }

OutputBuffer to_pool(metal::MetalEngine& engine, const std::vector<float>& host) {
    OutputBuffer b = engine.allocate(host.size() * sizeof(float));
    std::memcpy(b.data, host.data(), host.size() * sizeof(float));
    return b;
}

void check_case(metal::MetalEngine& metal, Engine& cpu, const Case& c, bool pool_inputs) {
    const size_t nq = size_t(c.B) * c.Tq * c.H * c.D, nkv = size_t(c.B) * c.Tk * c.Hkv * c.D;
    const size_t nl = size_t(c.B) * c.H * c.Tq;
    auto q = random_vector(nq, 1), k = random_vector(nkv, 2), v = random_vector(nkv, 3);
    auto dout = random_vector(nq, 4);
    AttentionOptions opt;
    opt.causal = c.causal, opt.window_left = c.left, opt.window_right = c.right;

    OutputBuffer pq = to_pool(metal, q), pk = to_pool(metal, k), pv = to_pool(metal, v);
    const float* qi = pool_inputs ? floats(pq) : q.data();
    const float* ki = pool_inputs ? floats(pk) : k.data();
    const float* vi = pool_inputs ? floats(pv) : v.data();
    const FlashParams p = make_forward_params(view(qi, c.B, c.Tq, c.H, c.D),
                                              view(ki, c.B, c.Tk, c.Hkv, c.D),
                                              view(vi, c.B, c.Tk, c.Hkv, c.D), opt);

    std::vector<float> o_cpu(nq), lse_cpu(nl);
    run_forward(cpu, p, {q.data(), k.data(), v.data(), o_cpu.data(), lse_cpu.data()});
    const metal::TransferStats before = metal.transfer_stats();
    OutputBuffer o = metal.allocate(nq * sizeof(float)), lse = metal.allocate(nl * sizeof(float));
    run_forward(metal, p, {qi, ki, vi, o.data, floats(lse)});
    const metal::TransferStats after = metal.transfer_stats();
    const double e_o = max_err(floats(o), o_cpu.data(), nq), e_l = max_err(floats(lse), lse_cpu.data(), nl);
    std::printf("  B=%d Tq=%d Tk=%d H=%d Hkv=%d D=%d causal=%d window=(%lld,%lld) %s: "
                "o %.2e lse %.2e",
                c.B, c.Tq, c.Tk, c.H, c.Hkv, c.D, int(c.causal), (long long)c.left,
                (long long)c.right, pool_inputs ? "pool" : "host", e_o, e_l);
    CHECK(e_o < 1e-4);
    CHECK(e_l < 1e-4);
    CHECK(after.input_copies - before.input_copies == (pool_inputs ? 0u : 3u));
    CHECK(after.outputs_in_place - before.outputs_in_place == 2u);

    // Determinism: the same call again gives the same bits.
    OutputBuffer o2 = metal.allocate(nq * sizeof(float)), lse2 = metal.allocate(nl * sizeof(float));
    run_forward(metal, p, {qi, ki, vi, o2.data, floats(lse2)});
    CHECK(std::memcmp(o.data, o2.data, nq * sizeof(float)) == 0);

    // Backward, with the metal engine's own o and lse; outputs in host memory
    // this time (computed in pool buffers, copied back).
    const FlashParams pb = make_backward_params(
        view(dout.data(), c.B, c.Tq, c.H, c.D), view(qi, c.B, c.Tq, c.H, c.D),
        view(ki, c.B, c.Tk, c.Hkv, c.D), view(vi, c.B, c.Tk, c.Hkv, c.D),
        view(floats(o), c.B, c.Tq, c.H, c.D),
        TensorView{lse.data, {c.B, c.H, c.Tq}, {int64_t(c.H) * c.Tq, c.Tq, 1}}, opt);
    std::vector<float> dq_cpu(nq), dk_cpu(nkv), dv_cpu(nkv), dq(nq), dk(nkv), dv(nkv);
    run_backward(cpu, pb, {dout.data(), q.data(), k.data(), v.data(), o.data, floats(lse),
                           dq_cpu.data(), dk_cpu.data(), dv_cpu.data()});
    run_backward(metal, pb, {dout.data(), qi, ki, vi, o.data, floats(lse), dq.data(), dk.data(),
                             dv.data()});
    const double e_dq = max_err(dq.data(), dq_cpu.data(), nq);
    const double e_dk = max_err(dk.data(), dk_cpu.data(), nkv);
    const double e_dv = max_err(dv.data(), dv_cpu.data(), nkv);
    std::printf(" dq %.2e dk %.2e dv %.2e\n", e_dq, e_dk, e_dv);
    CHECK(e_dq < 1e-3);
    CHECK(e_dk < 1e-3);
    CHECK(e_dv < 1e-3);
}

// The score options on the GPU against the cpu engine: softcap, (B, H)
// slopes, sinks and a mask broadcast from (Tk,) (staged as Tk bytes) or a
// transposed float one (strides kept), forward and backward with dsinks.
void check_options(metal::MetalEngine& metal, Engine& cpu) {
    const Case c{2, 37, 45, 4, 2, 64, true, -1, -1};
    const size_t nq = size_t(c.B) * c.Tq * c.H * c.D, nkv = size_t(c.B) * c.Tk * c.Hkv * c.D;
    const size_t nl = size_t(c.B) * c.H * c.Tq;
    auto q = random_vector(nq, 11), k = random_vector(nkv, 12), v = random_vector(nkv, 13);
    auto dout = random_vector(nq, 14);
    std::vector<float> slopes = {0.5f, 0.25f, 0.125f, 0.0625f, 0.3f, 0.2f, 0.1f, 0.05f};
    std::vector<float> sinks = {0.5f, -1.0f, -INFINITY, 2.0f};
    std::vector<unsigned char> keys(size_t(c.Tk));
    for (size_t j = 0; j < keys.size(); ++j) keys[j] = (j * 7) % 5 != 0;
    std::vector<float> transposed = random_vector(size_t(c.Tk) * c.Tq, 15);  // (Tk, Tq)
    AttentionOptions opt;
    opt.causal = true;
    for (int variant = 0; variant < 2; ++variant) {
        ScoreOptions so;
        so.softcap = 5.0;
        so.alibi_slopes = TensorView{slopes.data(), {c.B, c.H}, {c.H, 1}};
        so.sinks = TensorView{sinks.data(), {c.H}, {1}};
        if (variant == 0) {
            so.mask = TensorView{reinterpret_cast<const float*>(keys.data()),
                                 {c.B, c.H, c.Tq, c.Tk}, {0, 0, 0, 1}};
            so.mask_is_bool = true;
        } else {
            so.mask = TensorView{transposed.data(), {c.B, c.H, c.Tq, c.Tk}, {0, 0, 1, c.Tq}};
        }
        FlashParams p = make_forward_params(view(q.data(), c.B, c.Tq, c.H, c.D),
                                            view(k.data(), c.B, c.Tk, c.Hkv, c.D),
                                            view(v.data(), c.B, c.Tk, c.Hkv, c.D), opt);
        const ScoreInputs score = make_score_inputs("attention", p, so);
        std::vector<float> o_cpu(nq), lse_cpu(nl), o(nq), lse(nl);
        run_forward(cpu, p, {q.data(), k.data(), v.data(), o_cpu.data(), lse_cpu.data(), score});
        run_forward(metal, p, {q.data(), k.data(), v.data(), o.data(), lse.data(), score});
        const double e_o = max_err(o.data(), o_cpu.data(), nq);
        const double e_l = max_err(lse.data(), lse_cpu.data(), nl);

        FlashParams pb = make_backward_params(
            view(dout.data(), c.B, c.Tq, c.H, c.D), view(q.data(), c.B, c.Tq, c.H, c.D),
            view(k.data(), c.B, c.Tk, c.Hkv, c.D), view(v.data(), c.B, c.Tk, c.Hkv, c.D),
            view(o_cpu.data(), c.B, c.Tq, c.H, c.D),
            TensorView{lse_cpu.data(), {c.B, c.H, c.Tq}, {int64_t(c.H) * c.Tq, c.Tq, 1}}, opt);
        const ScoreInputs score_b = make_score_inputs("attention_backward", pb, so);
        std::vector<float> g_cpu[3] = {std::vector<float>(nq), std::vector<float>(nkv),
                                       std::vector<float>(nkv)};
        std::vector<float> g[3] = {std::vector<float>(nq), std::vector<float>(nkv),
                                   std::vector<float>(nkv)};
        std::vector<float> ds_cpu(size_t(c.H)), ds(size_t(c.H));
        BackwardIO io{dout.data(), q.data(), k.data(), v.data(), o_cpu.data(), lse_cpu.data(),
                      g_cpu[0].data(), g_cpu[1].data(), g_cpu[2].data(), score_b};
        io.dsinks = ds_cpu.data();
        run_backward(cpu, pb, io);
        io.dq = g[0].data(), io.dk = g[1].data(), io.dv = g[2].data(), io.dsinks = ds.data();
        run_backward(metal, pb, io);
        double e_g = 0;
        for (int a = 0; a < 3; ++a)
            e_g = std::max(e_g, max_err(g[a].data(), g_cpu[a].data(), g[a].size()));
        const double e_s = max_err(ds.data(), ds_cpu.data(), ds.size());
        std::printf("  options (%s mask): o %.2e lse %.2e grads %.2e dsinks %.2e\n",
                    variant == 0 ? "bool (Tk,)" : "float transposed", e_o, e_l, e_g, e_s);
        CHECK(e_o < 1e-4 && e_l < 1e-4);
        CHECK(e_g < 1e-3 && e_s < 1e-3);
    }
}

// The float16 / bfloat16 kernels (issue 15) on inputs of that type: each
// output within an ulp of the type of the float32 kernels' output on the
// same values (the 16-bit kernels compute in float32 from exactly those
// values and round once; metal-sim finds them bit-identical, the GPU's
// compiler may contract differently), lse within 1e-6 relative.
// (tiny: the type's smallest subnormal, its ulp near zero.)
template <class T>
void check_half_case(metal::MetalEngine& metal, const Case& c, DType dt, int mantissa_bits,
                     double tiny) {
    const size_t nq = size_t(c.B) * c.Tq * c.H * c.D, nkv = size_t(c.B) * c.Tk * c.Hkv * c.D;
    const size_t nl = size_t(c.B) * c.H * c.Tq;
    auto rounded = [&](size_t n, uint32_t seed, std::vector<T>& h) {
        std::vector<float> x = random_vector(n, seed);
        h.resize(n);
        for (size_t i = 0; i < n; ++i) h[i] = from_float<T>(x[i]), x[i] = to_float(h[i]);
        return x;
    };
    std::vector<T> qh, kh, vh, gh;
    const std::vector<float> q = rounded(nq, 11, qh), k = rounded(nkv, 12, kh), v = rounded(nkv, 13, vh);
    const std::vector<float> g = rounded(nq, 14, gh);
    AttentionOptions opt;
    opt.causal = c.causal, opt.window_left = c.left, opt.window_right = c.right;
    const FlashParams p = make_forward_params(view(q.data(), c.B, c.Tq, c.H, c.D),
                                              view(k.data(), c.B, c.Tk, c.Hkv, c.D),
                                              view(v.data(), c.B, c.Tk, c.Hkv, c.D), opt);
    auto within_ulp = [&](const char* what, const std::vector<T>& got, const std::vector<float>& want) {
        int bad = 0;
        for (size_t i = 0; i < got.size(); ++i) {
            const double w = want[i], e = std::abs(double(to_float(got[i])) - w);
            if (!(e <= std::max(std::ldexp(std::abs(w), -mantissa_bits), tiny))) ++bad;
        }
        if (bad) std::printf("  %s %s: %d of %zu elements off by more than an ulp\n", dtype_name(dt), what, bad, got.size());
        CHECK(bad == 0);
    };
    std::vector<float> o32(nq), lse32(nl), lse16(nl);
    std::vector<T> o16(nq);
    run_forward(metal, p, {q.data(), k.data(), v.data(), o32.data(), lse32.data()});
    ForwardIO io16{qh.data(), kh.data(), vh.data(), o16.data(), lse16.data()};
    io16.dtype = dt;
    run_forward(metal, p, io16);
    within_ulp("o", o16, o32);
    CHECK(max_err(lse16.data(), lse32.data(), nl) < 1e-6);

    // Backward from the 16-bit o (as float32 values for the float32 kernels).
    std::vector<float> o_full(nq);
    for (size_t i = 0; i < nq; ++i) o_full[i] = to_float(o16[i]);
    const FlashParams pb = make_backward_params(
        view(g.data(), c.B, c.Tq, c.H, c.D), view(q.data(), c.B, c.Tq, c.H, c.D),
        view(k.data(), c.B, c.Tk, c.Hkv, c.D), view(v.data(), c.B, c.Tk, c.Hkv, c.D),
        view(o_full.data(), c.B, c.Tq, c.H, c.D),
        TensorView{lse32.data(), {c.B, c.H, c.Tq}, {int64_t(c.H) * c.Tq, c.Tq, 1}}, opt);
    std::vector<float> dq(nq), dk(nkv), dv(nkv);
    std::vector<T> dqh(nq), dkh(nkv), dvh(nkv);
    run_backward(metal, pb, {g.data(), q.data(), k.data(), v.data(), o_full.data(), lse32.data(),
                             dq.data(), dk.data(), dv.data()});
    BackwardIO b16{gh.data(), qh.data(), kh.data(), vh.data(), o16.data(), lse32.data(),
                   dqh.data(), dkh.data(), dvh.data()};
    b16.dtype = dt;
    run_backward(metal, pb, b16);
    within_ulp("dq", dqh, dq);
    within_ulp("dk", dkh, dk);
    within_ulp("dv", dvh, dv);
}

void check_concurrent_calls(metal::MetalEngine& metal) {
    const Case c{2, 77, 77, 4, 1, 64, true, -1, -1};
    const size_t nq = size_t(c.B) * c.Tq * c.H * c.D, nkv = size_t(c.B) * c.Tk * c.Hkv * c.D;
    auto q = random_vector(nq, 5), k = random_vector(nkv, 6), v = random_vector(nkv, 7);
    AttentionOptions opt;
    opt.causal = true;
    const FlashParams p = make_forward_params(view(q.data(), c.B, c.Tq, c.H, c.D),
                                              view(k.data(), c.B, c.Tk, c.Hkv, c.D),
                                              view(v.data(), c.B, c.Tk, c.Hkv, c.D), opt);
    std::vector<float> want(nq), lse(size_t(c.B) * c.H * c.Tq);
    run_forward(metal, p, {q.data(), k.data(), v.data(), want.data(), lse.data()});
    constexpr int kThreads = 4, kRounds = 20;
    std::vector<int> mismatches(kThreads, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
        threads.emplace_back([&, t] {
            std::vector<float> o(nq), l(lse.size());
            for (int r = 0; r < kRounds; ++r) {
                run_forward(metal, p, {q.data(), k.data(), v.data(), o.data(), l.data()});
                if (std::memcmp(o.data(), want.data(), nq * sizeof(float)) != 0) ++mismatches[t];
            }
        });
    for (auto& th : threads) th.join();
    for (int m : mismatches) CHECK(m == 0);
}

void check_missing_metallib() {
    const char* old = std::getenv("FLASHATTN_METALLIB");
    const std::string saved = old ? old : "";
    setenv("FLASHATTN_METALLIB", "/nonexistent/flashattn.metallib", 1);
    CHECK_THROWS(std::runtime_error, "/nonexistent/flashattn.metallib (not found)",
                 make_metal_engine());
    if (old) setenv("FLASHATTN_METALLIB", saved.c_str(), 1);
    else unsetenv("FLASHATTN_METALLIB");
}

}  // namespace

int main() {
    std::unique_ptr<Engine> engine;
    try {
        engine = make_metal_engine();
    } catch (const std::runtime_error& e) {
        // A GPU the kernels cannot run on (a paravirtual Apple5 runner): skipped, saying which.
        if (std::string(e.what()).find("GPU family") == std::string::npos) throw;
        std::printf("test_metal_engine: %s: SKIPPED\n", e.what());
        return 77;
    }
    if (!engine) {
        std::printf("test_metal_engine: no Metal device on this machine: SKIPPED\n");
        return 77;
    }
    auto& metal = dynamic_cast<metal::MetalEngine&>(*engine);
    std::printf("device: %s\n", metal.device_name().c_str());
    std::unique_ptr<Engine> cpu = make_cpu_engine();

    const Case cases[] = {
        {1, 64, 64, 2, 2, 64, false, -1, -1},
        {2, 113, 203, 4, 2, 59, true, -1, -1},   // Tq != Tk, odd D, GQA
        {1, 200, 200, 8, 1, 128, true, 32, 0},   // MQA, sliding window
        {2, 33, 17, 3, 3, 16, true, -1, -1},     // Tq > Tk: leading rows see no key
        {1, 70, 90, 2, 1, 256, false, 5, 7},
        {1, 9, 300, 2, 2, 8, false, -1, -1},
    };
    for (const Case& c : cases) {
        check_case(metal, *cpu, c, /*pool_inputs=*/false);
        check_case(metal, *cpu, c, /*pool_inputs=*/true);
    }
    check_options(metal, *cpu);
    for (const Case& c : cases) {
        check_half_case<Half>(metal, c, DType::f16, 10, std::ldexp(1.0, -24));
        check_half_case<BFloat16>(metal, c, DType::bf16, 7, std::ldexp(1.0, -133));
    }
    check_concurrent_calls(metal);
    check_missing_metallib();

    const metal::PoolStats s = metal.pool_stats();
    std::printf("pool: %zu active bytes, %zu cached, %llu allocations, %llu reuses\n",
                s.active_bytes, s.cached_bytes, (unsigned long long)s.allocations,
                (unsigned long long)s.reuses);
    CHECK(s.reuses > 0);
    return flashattn_test::finish("test_metal_engine");
}
