// metal-sim (the Metal kernels run on the CPU) and the cpu engine give the
// same answers, within the test tolerance, on a grid of shapes x masks:
// forward (o, lse) and backward (dq, dk, dv), strided inputs on every other
// case, and exactly o = 0, lse = -inf, zero gradient on rows that see no key.
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "core/engine.h"
#include "core/params.h"
#include "engines/factories.h"

using namespace flashattn;

namespace {

struct Shape {
    int B, Tq, Tk, H, Hkv, D;
};
struct Mask {
    const char* name;
    bool causal;
    int64_t left, right;
};

// A (B, T, heads, D) view over its own memory; strided: padded rows and heads.
struct Array {
    std::vector<float> mem;
    TensorView view;
};

Array make(int64_t B, int64_t T, int64_t Hh, int64_t D, bool strided, std::mt19937& rng) {
    Array a;
    const int64_t sh = strided ? D + 5 : D, st = Hh * sh + (strided ? 3 : 0), sb = T * st;
    a.mem.resize(size_t(B * sb));
    std::uniform_real_distribution<float> u(-1.5f, 1.5f);
    for (auto& x : a.mem) x = u(rng);
    a.view = TensorView{a.mem.data(), {B, T, Hh, D}, {sb, st, sh, 1}};
    return a;
}

double worst = 0;

void agree(const char* what, const std::vector<float>& sim, const std::vector<float>& cpu,
           double tol, const std::string& label) {
    double max_ref = 0, max_err = 0;
    int mismatched_inf = 0, nonfinite = 0;
    for (size_t n = 0; n < cpu.size(); ++n) {
        if (std::isinf(cpu[n]) || std::isinf(sim[n])) {
            mismatched_inf += !(sim[n] == cpu[n]);  // -inf lse of a row that sees no key
            continue;
        }
        if (!std::isfinite(sim[n]) || !std::isfinite(cpu[n])) {
            ++nonfinite;
            continue;
        }
        max_ref = std::max(max_ref, double(std::abs(cpu[n])));
        max_err = std::max(max_err, double(std::abs(sim[n] - cpu[n])));
    }
    const double rel = max_err / (1.0 + max_ref);
    worst = std::max(worst, rel);
    if (rel > tol || mismatched_inf || nonfinite) {
        std::printf("  %s %s: max |sim - cpu| %.3g (rel %.3g > %.3g?), %d -inf mismatches, %d NaN\n",
                    label.c_str(), what, max_err, rel, tol, mismatched_inf, nonfinite);
        CHECK(false);
    }
}

}  // namespace

int main() {
    auto sim = make_metal_sim_engine();
    auto cpu = make_cpu_engine();
    const Shape shapes[] = {
        {1, 1, 1, 1, 1, 1},      {2, 113, 203, 4, 2, 59}, {1, 203, 113, 2, 1, 64},
        {1, 1, 257, 4, 1, 128},  {1, 64, 64, 3, 3, 111},  {1, 100, 100, 2, 1, 256},
        {2, 77, 77, 2, 2, 1},    {1, 130, 70, 4, 2, 96},
    };
    const Mask masks[] = {
        {"full", false, -1, -1},      {"causal", true, -1, -1}, {"window(16,4)", false, 16, 4},
        {"causal window 8", true, 7, -1}, {"window(0,0)", false, 0, 0},
    };
    int cases = 0;
    std::mt19937 rng(77);
    for (const Shape& s : shapes)
        for (const Mask& m : masks) {
            const bool strided = cases % 2 == 1;
            char label[160];
            std::snprintf(label, sizeof label, "B=%d Tq=%d Tk=%d H=%d Hkv=%d D=%d %s%s", s.B, s.Tq,
                          s.Tk, s.H, s.Hkv, s.D, m.name, strided ? " strided" : "");
            const Array q = make(s.B, s.Tq, s.H, s.D, strided, rng);
            const Array k = make(s.B, s.Tk, s.Hkv, s.D, strided, rng);
            const Array v = make(s.B, s.Tk, s.Hkv, s.D, strided, rng);
            const Array dout = make(s.B, s.Tq, s.H, s.D, strided, rng);
            if (!flashattn_test::case_selected()) continue;
            AttentionOptions opt;
            opt.causal = m.causal;
            opt.window_left = m.left;
            opt.window_right = m.right;
            const FlashParams pf = make_forward_params(q.view, k.view, v.view, opt);

            std::vector<float> o[2], lse[2], dq[2], dk[2], dv[2];
            Engine* engines[2] = {sim.get(), cpu.get()};
            for (int e = 0; e < 2; ++e) {
                o[e].assign(size_t(q_elements(pf)), 0.0f);
                lse[e].assign(size_t(lse_elements(pf)), 0.0f);
                run_forward(*engines[e], pf,
                            ForwardIO{q.view.data, k.view.data, v.view.data, o[e].data(), lse[e].data()});
            }
            agree("o", o[0], o[1], 2e-5, label);
            agree("lse", lse[0], lse[1], 2e-5, label);

            // Both backwards from the cpu engine's forward, so they answer the same question.
            const TensorView o_view{o[1].data(), {s.B, s.Tq, s.H, s.D},
                                    {int64_t(s.Tq) * s.H * s.D, int64_t(s.H) * s.D, s.D, 1}};
            const TensorView lse_view{lse[1].data(), {s.B, s.H, s.Tq}, {int64_t(s.H) * s.Tq, s.Tq, 1}};
            const FlashParams pb = make_backward_params(dout.view, q.view, k.view, v.view, o_view,
                                                        lse_view, opt);
            for (int e = 0; e < 2; ++e) {
                dq[e].assign(size_t(q_elements(pb)), 0.0f);
                dk[e].assign(size_t(kv_elements(pb)), 0.0f);
                dv[e].assign(size_t(kv_elements(pb)), 0.0f);
                run_backward(*engines[e], pb,
                             BackwardIO{dout.view.data, q.view.data, k.view.data, v.view.data,
                                        o[1].data(), lse[1].data(), dq[e].data(), dk[e].data(),
                                        dv[e].data()});
            }
            agree("dq", dq[0], dq[1], 1e-4, label);
            agree("dk", dk[0], dk[1], 1e-4, label);
            agree("dv", dv[0], dv[1], 1e-4, label);

            // Rows that see no key: exactly the same zeros in both.
            int masked = 0;
            for (size_t n = 0; n < lse[1].size(); ++n) masked += std::isinf(lse[1][n]);
            ++cases;
            std::printf("  ok  %s%s\n", label,
                        masked ? (" (" + std::to_string(masked) + " rows see no key)").c_str() : "");
        }
    std::printf("%d cases, worst relative difference %.3g\n", cases, worst);
    return flashattn_test::finish("test_sim_vs_cpu");
}
