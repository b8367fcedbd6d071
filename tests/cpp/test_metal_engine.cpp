// The metal engine on a real GPU (Apple only): forward and backward against
// the cpu engine on awkward shapes, host arrays (one copy each) versus pool
// arrays (in place), determinism, concurrent calls, and the error that lists
// the metallib paths tried. Exits 77 (ctest: skipped) on a Mac without a
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
    check_concurrent_calls(metal);
    check_missing_metallib();

    const metal::PoolStats s = metal.pool_stats();
    std::printf("pool: %zu active bytes, %zu cached, %llu allocations, %llu reuses\n",
                s.active_bytes, s.cached_bytes, (unsigned long long)s.allocations,
                (unsigned long long)s.reuses);
    CHECK(s.reuses > 0);
    return flashattn_test::finish("test_metal_engine");
}
