// Every metal-sim kernel (forward, backward preprocess, dQ, dK/dV, in every
// head-size bucket) run through the metal-sim engine against a naive float64
// double loop: causal or not, Tq != Tk both ways, decode (Tq = 1), windows,
// GQA/MQA, awkward head sizes, strided inputs and rows that see no key.
// `--quick` runs a few cases per kernel (the sanitizer builds use it).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "check.h"
#include "core/engine.h"
#include "core/params.h"
#include "core/plan.h"
#include "engines/factories.h"
#include "sim/launcher.h"

using namespace flashattn;

namespace {

struct Case {
    int B, Tq, Tk, H, Hkv, D;
    bool causal;
    int64_t left, right;  // -1: unbounded
    bool strided;
};

std::string describe(const Case& c) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "B=%d Tq=%d Tk=%d H=%d Hkv=%d D=%d causal=%d window=(%lld,%lld)%s",
                  c.B, c.Tq, c.Tk, c.H, c.Hkv, c.D, int(c.causal), (long long)c.left,
                  (long long)c.right, c.strided ? " strided" : "");
    return buf;
}

// A (B, T, heads, D) array in memory of its own, contiguous or not (the
// last axis always contiguous), filled with values in [-1, 1).
struct Array {
    std::vector<float> mem;
    std::vector<int64_t> shape, strides;
    const float* data() const { return mem.data(); }
    float& at(int64_t b, int64_t t, int64_t h, int64_t d) {
        return mem[size_t(b * strides[0] + t * strides[1] + h * strides[2] + d)];
    }
    float at(int64_t b, int64_t t, int64_t h, int64_t d) const {
        return mem[size_t(b * strides[0] + t * strides[1] + h * strides[2] + d)];
    }
    TensorView view() const { return {mem.data(), shape, strides}; }
};

Array make_array(int64_t B, int64_t T, int64_t Hh, int64_t D, bool strided, std::mt19937& rng,
                 int layout_seed) {
    Array a;
    a.shape = {B, T, Hh, D};
    if (!strided) {
        a.strides = {T * Hh * D, Hh * D, D, 1};
    } else if (layout_seed % 2 == 0) {
        // Padded rows, as when sliced out of a packed qkv array.
        const int64_t sh = D + 3, st = Hh * sh + 5, sb = T * st + 7;
        a.strides = {sb, st, sh, 1};
    } else {
        // Head-major (B, H, T, D) memory seen through a (B, T, H, D) view.
        const int64_t st = D + 1, sh = T * st + 2, sb = Hh * sh + 3;
        a.strides = {sb, st, sh, 1};
    }
    int64_t extent = 1;
    for (int i = 0; i < 4; ++i) extent += (a.shape[i] - 1) * a.strides[i];
    a.mem.assign(size_t(extent), std::numeric_limits<float>::quiet_NaN());  // gaps stay NaN
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < Hh; ++h)
                for (int64_t d = 0; d < D; ++d) a.at(b, t, h, d) = dist(rng);
    return a;
}

struct Reference {
    std::vector<double> o, lse, dq, dk, dv;  // contiguous
};

// The contract in its plainest form, in double.
Reference reference(const Case& c, const FlashParams& p, const Array& q, const Array& k,
                    const Array& v, const Array& dout) {
    Reference r;
    const int B = c.B, Tq = c.Tq, Tk = c.Tk, H = c.H, D = c.D, group = c.H / c.Hkv;
    r.o.assign(size_t(B) * Tq * H * D, 0.0);
    r.dq.assign(r.o.size(), 0.0);
    r.lse.assign(size_t(B) * H * Tq, -std::numeric_limits<double>::infinity());
    r.dk.assign(size_t(B) * Tk * c.Hkv * D, 0.0);
    r.dv.assign(r.dk.size(), 0.0);
    std::vector<double> s(Tk), pr(Tk), dp(Tk);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h) {
            const int hk = h / group;
            for (int i = 0; i < Tq; ++i) {
                const int64_t pos = int64_t(i) + Tk - Tq;
                double m = -std::numeric_limits<double>::infinity();
                std::vector<bool> seen(Tk, false);
                for (int j = 0; j < Tk; ++j) {
                    seen[j] = j >= pos - p.window_left && j <= pos + p.window_right;
                    if (!seen[j]) continue;
                    double dot = 0;
                    for (int d = 0; d < D; ++d) dot += double(q.at(b, i, h, d)) * k.at(b, j, hk, d);
                    s[j] = dot * p.scale;
                    m = std::max(m, s[j]);
                }
                if (m == -std::numeric_limits<double>::infinity()) continue;  // sees no key
                double l = 0;
                for (int j = 0; j < Tk; ++j)
                    if (seen[j]) l += std::exp(s[j] - m);
                const double lse = m + std::log(l);
                r.lse[(size_t(b) * H + h) * Tq + i] = lse;
                const size_t orow = ((size_t(b) * Tq + i) * H + h) * D;
                for (int j = 0; j < Tk; ++j) {
                    pr[j] = seen[j] ? std::exp(s[j] - lse) : 0.0;
                    if (!seen[j]) continue;
                    for (int d = 0; d < D; ++d) r.o[orow + d] += pr[j] * v.at(b, j, hk, d);
                }
                // Backward of this row.
                double delta = 0;
                for (int d = 0; d < D; ++d) delta += double(dout.at(b, i, h, d)) * r.o[orow + d];
                for (int j = 0; j < Tk; ++j) {
                    if (!seen[j]) continue;
                    double g = 0;
                    for (int d = 0; d < D; ++d) g += double(dout.at(b, i, h, d)) * v.at(b, j, hk, d);
                    const double ds = pr[j] * (g - delta) * p.scale;
                    const size_t krow = ((size_t(b) * Tk + j) * c.Hkv + hk) * D;
                    for (int d = 0; d < D; ++d) {
                        r.dq[orow + d] += ds * k.at(b, j, hk, d);
                        r.dk[krow + d] += ds * q.at(b, i, h, d);
                        r.dv[krow + d] += pr[j] * dout.at(b, i, h, d);
                    }
                }
            }
        }
    return r;
}

// Max |got - want| relative to (1 + max |want|); -inf must match exactly.
double compare(const char* what, const std::vector<float>& got, const std::vector<double>& want,
               const std::string& label, double tol) {
    double max_ref = 0, max_err = 0;
    bool bad = false;
    for (size_t n = 0; n < want.size(); ++n) {
        const double w = want[n], g = got[n];
        if (std::isinf(w)) {
            if (!(std::isinf(g) && g < 0)) bad = true;
            continue;
        }
        if (!std::isfinite(g)) {
            bad = true;
            continue;
        }
        max_ref = std::max(max_ref, std::abs(w));
        max_err = std::max(max_err, std::abs(g - w));
    }
    const double rel = max_err / (1.0 + max_ref);
    if (bad || rel > tol) {
        std::printf("  %s: %s max err %.3g (rel %.3g, tol %.3g)%s\n", label.c_str(), what, max_err,
                    rel, tol, bad ? " non-finite or -inf mismatch" : "");
        CHECK(false);
    }
    return rel;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

double g_worst = 0;

void run_case(Engine& engine, const Case& c, uint32_t seed, bool check_repeat) {
    std::mt19937 rng(seed);
    const Array q = make_array(c.B, c.Tq, c.H, c.D, c.strided, rng, 0);
    const Array k = make_array(c.B, c.Tk, c.Hkv, c.D, c.strided, rng, 1);
    const Array v = make_array(c.B, c.Tk, c.Hkv, c.D, c.strided, rng, 0);
    const Array dout = make_array(c.B, c.Tq, c.H, c.D, c.strided, rng, 1);
    AttentionOptions opt;
    opt.causal = c.causal;
    opt.window_left = c.left;
    opt.window_right = c.right;
    const FlashParams pf = make_forward_params(q.view(), k.view(), v.view(), opt);
    const std::string label = describe(c);

    // Outputs start as NaN so an element the kernels never write shows up.
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> o(size_t(q_elements(pf)), nan), lse(size_t(lse_elements(pf)), nan);
    run_forward(engine, pf, ForwardIO{q.data(), k.data(), v.data(), o.data(), lse.data()});

    const Reference ref = reference(c, pf, q, k, v, dout);
    const double tol = 2e-5;
    g_worst = std::max(g_worst, compare("o", o, ref.o, label, tol));
    g_worst = std::max(g_worst, compare("lse", lse, ref.lse, label, tol));

    const TensorView lse_view{lse.data(), {c.B, c.H, c.Tq}, {int64_t(c.H) * c.Tq, c.Tq, 1}};
    const TensorView o_view{o.data(), {c.B, c.Tq, c.H, c.D},
                            {int64_t(c.Tq) * c.H * c.D, int64_t(c.H) * c.D, c.D, 1}};
    const FlashParams pb =
        make_backward_params(dout.view(), q.view(), k.view(), v.view(), o_view, lse_view, opt);
    std::vector<float> dq(size_t(q_elements(pb)), nan), dk(size_t(kv_elements(pb)), nan),
        dv(size_t(kv_elements(pb)), nan);
    const BackwardIO bio{dout.data(), q.data(), k.data(), v.data(), o.data(), lse.data(),
                         dq.data(),   dk.data(), dv.data()};
    run_backward(engine, pb, bio);
    g_worst = std::max(g_worst, compare("dq", dq, ref.dq, label, 4 * tol));
    g_worst = std::max(g_worst, compare("dk", dk, ref.dk, label, 4 * tol));
    g_worst = std::max(g_worst, compare("dv", dv, ref.dv, label, 4 * tol));

    // Rows that see no key: exactly zero output and gradient.
    int masked = 0;
    for (int b = 0; b < c.B; ++b)
        for (int h = 0; h < c.H; ++h)
            for (int i = 0; i < c.Tq; ++i) {
                if (!std::isinf(ref.lse[(size_t(b) * c.H + h) * c.Tq + i])) continue;
                ++masked;
                const size_t row = ((size_t(b) * c.Tq + i) * c.H + h) * c.D;
                for (int d = 0; d < c.D; ++d) {
                    CHECK(o[row + d] == 0.0f);
                    CHECK(dq[row + d] == 0.0f);
                }
            }
    if (check_repeat) {  // deterministic: bit-identical on a second run
        std::vector<float> o2(o.size()), lse2(lse.size()), dq2(dq.size()), dk2(dk.size()),
            dv2(dv.size());
        run_forward(engine, pf, ForwardIO{q.data(), k.data(), v.data(), o2.data(), lse2.data()});
        run_backward(engine, pb,
                     BackwardIO{dout.data(), q.data(), k.data(), v.data(), o.data(), lse.data(),
                                dq2.data(), dk2.data(), dv2.data()});
        CHECK(bit_equal(o, o2) && bit_equal(lse, lse2));
        CHECK(bit_equal(dq, dq2) && bit_equal(dk, dk2) && bit_equal(dv, dv2));
    }
    std::printf("  ok  %s%s\n", label.c_str(),
                masked ? (" (" + std::to_string(masked) + " rows see no key)").c_str() : "");
}

}  // namespace

int main(int argc, char** argv) {
    // Sanitizer builds run every GPU thread as a std::thread under the
    // sanitizer: the quick set (one case per kernel) keeps them in budget.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    const bool quick = true;
    (void)argc, (void)argv;
#else
    const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
#endif
    auto engine = make_metal_sim_engine();
    std::printf("metal-sim execution mode: %s\n", sim::execution_mode());
    CHECK(engine->name() == "metal-sim");

    // B, Tq, Tk, H, Hkv, D, causal, left, right, strided
    std::vector<Case> cases = {
        // one case per head-size bucket (and so per kernel instantiation)
        {1, 70, 70, 2, 1, 1, true, -1, -1, false},     // hd32, D = 1, MQA
        {1, 65, 130, 2, 2, 59, false, -1, -1, true},   // hd64, Tq < Tk, strided
        {2, 40, 33, 2, 1, 77, true, 9, -1, false},     // hd96, Tq > Tk, window: masked rows
        {1, 100, 67, 4, 2, 111, false, -1, -1, true},  // hd128, GQA, Tq > Tk
        {1, 33, 47, 2, 1, 256, true, -1, -1, false},   // hd256
        {1, 1, 700, 8, 2, 64, false, -1, -1, false},   // decode: split keys, then the merge
        {1, 3, 600, 2, 2, 40, true, -1, -1, true},     // MHA decode: the vector kernel, split
    };
    const std::vector<Case> full = {
        {1, 128, 128, 2, 2, 64, false, -1, -1, false},
        {1, 128, 128, 2, 2, 64, true, -1, -1, false},
        {2, 113, 203, 4, 2, 64, true, -1, -1, true},   // Tq < Tk, causal bottom-right
        {1, 203, 113, 4, 1, 59, true, -1, -1, false},  // Tq > Tk causal: first 90 rows masked
        {1, 1, 150, 4, 2, 64, true, -1, -1, false},    // decode
        {1, 1, 150, 4, 4, 111, false, 20, 0, true},    // decode, window
        {1, 1, 1, 1, 1, 1, false, -1, -1, false},
        {2, 150, 150, 4, 2, 64, false, 16, 7, false},  // two-sided window, blocks skipped
        {1, 150, 150, 2, 1, 32, true, 0, -1, true},    // window (0, 0): diagonal only
        {1, 90, 200, 3, 1, 59, false, 5, 2, true},     // window with Tq < Tk: masked rows
        {1, 200, 90, 3, 3, 111, false, 3, 3, false},   // window with Tq > Tk: masked rows
        {1, 64, 64, 8, 1, 96, false, -1, -1, true},    // MQA
        {1, 129, 65, 2, 1, 256, false, 30, 30, true},
        {1, 70, 70, 2, 2, 128, true, -1, -1, true},
        {1, 47, 300, 2, 1, 1, false, -1, 10, false},
    };
    if (!quick) cases.insert(cases.end(), full.begin(), full.end());

    // Every kernel name the plans can emit is compiled into the simulator.
    std::set<std::string> launched;
    for (const Case& c : cases) {
        FlashParams p{};
        p.B = c.B, p.Tq = c.Tq, p.Tk = c.Tk, p.H = c.H, p.Hkv = c.Hkv, p.D = c.D;
        p.group = c.H / c.Hkv;
        for (const Plan& plan : {plan_forward(p), plan_backward(p)})
            for (const Launch& l : plan.launches) launched.insert(l.kernel);
    }
    std::printf("%zu kernels launched by these cases\n", launched.size());
    // preprocess, merge + 5 buckets x (fwd, dq, dkdv), and the vector decode
    // kernel of the MHA decode cases' buckets (D = 40: hd64; the full set's
    // D = 1: hd32, D = 111: hd128).
    CHECK(launched.count("flash_decode_f32_hd64") == 1);
    CHECK(launched.size() == 2 + 5 * 3 + (quick ? 1 : 3));

    uint32_t seed = 1234;
    for (const Case& c : cases) run_case(*engine, c, seed++, &c == &cases.front());
    std::printf("%zu cases, worst relative error %.3g\n", cases.size(), g_worst);
    return flashattn_test::finish("test_sim_kernels");
}
