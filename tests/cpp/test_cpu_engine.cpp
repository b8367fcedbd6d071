// The cpu engine against a naive double-precision attention written here:
// forward and backward over causal and windowed masks, Tq != Tk, GQA/MQA,
// awkward head sizes, strided inputs and rows that see no key; plus
// bit-for-bit determinism across runs, thread counts and concurrent callers;
// and float16 / bfloat16 inputs, whose results must be the float32 path's on
// the same values, rounded once (the conversions of every ISA path).
// On the instruction-set path FLASHATTN_CPU_ISA names (the best one if unset).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "core/engine.h"
#include "core/half.h"
#include "core/params.h"
#include "core/varlen.h"
#include "cpu/isa.h"
#include "cpu/thread_pool.h"
#include "engines/factories.h"

using namespace flashattn;

namespace {

struct Case {
    int B, Tq, Tk, H, Hkv, D;
    bool causal;
    int64_t left = -1, right = -1;
    int layout = 0;  // 0 contiguous, 1 padded strides (packed qkv-like), 2 reversed time axis
    float amp = 1.0f;  // magnitude of q and k: large values make scores jump between key blocks
};

// A (B, T, heads, D) float32 array in a buffer with the strides the case asks for.
struct Array {
    std::vector<float> buf;
    int64_t origin = 0;
    int64_t B, T, Hh, D;
    int64_t sb, st, sh;

    Array(int64_t B_, int64_t T_, int64_t H_, int64_t D_, int layout, std::mt19937& rng,
          float amp = 1.0f)
        : B(B_), T(T_), Hh(H_), D(D_) {
        if (layout == 0) {
            sh = D, st = H_ * D, sb = T_ * st;
        } else {
            sh = D + 3, st = H_ * sh + 5, sb = T_ * st + 7;
        }
        buf.assign(size_t(B * sb + 16), std::numeric_limits<float>::quiet_NaN());
        if (layout == 2) {  // time runs backwards in memory: negative stride
            origin = (T - 1) * st;
            st = -st;
        }
        std::normal_distribution<float> dist(0.0f, 1.0f);
        for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t h = 0; h < Hh; ++h)
                    for (int64_t d = 0; d < D; ++d) at(b, t, h, d) = amp * dist(rng);
    }
    float& at(int64_t b, int64_t t, int64_t h, int64_t d) {
        return buf[size_t(origin + b * sb + t * st + h * sh + d)];
    }
    float at(int64_t b, int64_t t, int64_t h, int64_t d) const {
        return buf[size_t(origin + b * sb + t * st + h * sh + d)];
    }
    const float* data() const { return buf.data() + origin; }
    TensorView view() const { return {data(), {B, T, Hh, D}, {sb, st, sh, 1}}; }
};

TensorView contiguous_view(const std::vector<float>& x, int64_t B, int64_t T, int64_t H,
                           int64_t D) {
    return {x.data(), {B, T, H, D}, {T * H * D, H * D, D, 1}};
}

struct Reference {
    std::vector<double> o, lse, dq, dk, dv;
};

// Attention straight from the definition, in double, with the masking rule
// spelled out here rather than taken from flash_params.h.
Reference reference(const Case& c, const FlashParams& p, const Array& q, const Array& k,
                    const Array& v, const Array& dout) {
    Reference r;
    const int64_t B = c.B, Tq = c.Tq, Tk = c.Tk, H = c.H, D = c.D, Hkv = c.Hkv;
    r.o.assign(size_t(B * Tq * H * D), 0.0);
    r.lse.assign(size_t(B * H * Tq), -INFINITY);
    r.dq.assign(size_t(B * Tq * H * D), 0.0);
    r.dk.assign(size_t(B * Tk * Hkv * D), 0.0);
    r.dv.assign(size_t(B * Tk * Hkv * D), 0.0);
    const double scale = p.scale;
    std::vector<double> s(Tk), pr(Tk), dp(Tk);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t hk = h / (H / Hkv);
            for (int64_t i = 0; i < Tq; ++i) {
                const int64_t pos = i + Tk - Tq;
                auto visible = [&](int64_t j) {
                    if (c.causal && j > pos) return false;
                    if (c.left >= 0 && j < pos - c.left) return false;
                    if (c.right >= 0 && j > pos + c.right) return false;
                    return true;
                };
                double mx = -INFINITY;
                for (int64_t j = 0; j < Tk; ++j) {
                    if (!visible(j)) continue;
                    double acc = 0;
                    for (int64_t d = 0; d < D; ++d) acc += double(q.at(b, i, h, d)) * k.at(b, j, hk, d);
                    s[j] = acc * scale;
                    mx = std::max(mx, s[j]);
                }
                if (mx == -INFINITY) continue;  // sees no key: o = 0, lse = -inf, no gradient
                double l = 0;
                for (int64_t j = 0; j < Tk; ++j) l += visible(j) ? std::exp(s[j] - mx) : 0.0;
                const double lse = mx + std::log(l);
                r.lse[size_t((b * H + h) * Tq + i)] = lse;
                double* o = &r.o[size_t(((b * Tq + i) * H + h) * D)];
                for (int64_t j = 0; j < Tk; ++j) {
                    pr[j] = visible(j) ? std::exp(s[j] - lse) : 0.0;
                    for (int64_t d = 0; d < D; ++d) o[d] += pr[j] * v.at(b, j, hk, d);
                }
                double delta = 0;
                for (int64_t j = 0; j < Tk; ++j) {
                    dp[j] = 0;
                    for (int64_t d = 0; d < D; ++d) dp[j] += double(dout.at(b, i, h, d)) * v.at(b, j, hk, d);
                    delta += pr[j] * dp[j];
                }
                double* dq = &r.dq[size_t(((b * Tq + i) * H + h) * D)];
                for (int64_t j = 0; j < Tk; ++j) {
                    if (pr[j] == 0.0) continue;
                    const double ds = pr[j] * (dp[j] - delta) * scale;
                    double* dk = &r.dk[size_t(((b * Tk + j) * Hkv + hk) * D)];
                    double* dv = &r.dv[size_t(((b * Tk + j) * Hkv + hk) * D)];
                    for (int64_t d = 0; d < D; ++d) {
                        dq[d] += ds * k.at(b, j, hk, d);
                        dk[d] += ds * q.at(b, i, h, d);
                        dv[d] += pr[j] * dout.at(b, i, h, d);
                    }
                }
            }
        }
    return r;
}

// Largest error relative to the largest reference magnitude (plus one, so
// all-zero references compare absolutely); NaN counts as infinitely wrong.
double error(const std::vector<float>& got, const std::vector<double>& want) {
    double worst = 0, scale = 1;
    for (size_t i = 0; i < want.size(); ++i)
        if (std::isfinite(want[i])) scale = std::max(scale, std::abs(want[i]));
    for (size_t i = 0; i < want.size(); ++i) {
        double e;
        if (std::isinf(want[i])) e = (got[i] == want[i]) ? 0.0 : INFINITY;
        else e = std::isfinite(got[i]) ? std::abs(got[i] - want[i]) : INFINITY;
        worst = std::max(worst, e);
    }
    return worst / scale;
}

struct Outputs {
    std::vector<float> o, lse, dq, dk, dv;
    bool operator==(const Outputs& x) const {
        auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
            return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
        };
        return same(o, x.o) && same(lse, x.lse) && same(dq, x.dq) && same(dk, x.dk) &&
               same(dv, x.dv);
    }
};

struct Problem {
    Case c;
    Array q, k, v, dout;
    AttentionOptions opt;

    Problem(const Case& c_, uint32_t seed)
        : c(c_),
          q(c.B, c.Tq, c.H, c.D, c.layout, rng(seed), c.amp),
          k(c.B, c.Tk, c.Hkv, c.D, c.layout, rng(seed + 1), c.amp),
          v(c.B, c.Tk, c.Hkv, c.D, c.layout, rng(seed + 2)),
          dout(c.B, c.Tq, c.H, c.D, c.layout, rng(seed + 3)) {
        opt.causal = c.causal;
        opt.window_left = c.left;
        opt.window_right = c.right;
    }
    static std::mt19937& rng(uint32_t seed) {
        thread_local std::mt19937 r;
        r.seed(seed);
        return r;
    }

    Outputs run(Engine& e) const {
        Outputs out;
        const FlashParams p = make_forward_params(q.view(), k.view(), v.view(), opt);
        out.o.assign(size_t(q_elements(p)), NAN);
        out.lse.assign(size_t(lse_elements(p)), NAN);
        run_forward(e, p, {q.data(), k.data(), v.data(), out.o.data(), out.lse.data()});
        const TensorView o_view = contiguous_view(out.o, c.B, c.Tq, c.H, c.D);
        const TensorView lse_view{out.lse.data(), {c.B, c.H, c.Tq},
                                  {int64_t(c.H) * c.Tq, c.Tq, 1}};
        const FlashParams pb = make_backward_params(dout.view(), q.view(), k.view(), v.view(),
                                                    o_view, lse_view, opt);
        out.dq.assign(size_t(q_elements(pb)), NAN);
        out.dk.assign(size_t(kv_elements(pb)), NAN);
        out.dv.assign(size_t(kv_elements(pb)), NAN);
        run_backward(e, pb, {dout.data(), q.data(), k.data(), v.data(), out.o.data(),
                             out.lse.data(), out.dq.data(), out.dk.data(), out.dv.data()});
        return out;
    }
};

void check_case(Engine& e, const Case& c, uint32_t seed) {
    if (!flashattn_test::case_selected()) return;
    const Problem prob(c, seed);
    const Outputs out = prob.run(e);
    const FlashParams p = make_forward_params(prob.q.view(), prob.k.view(), prob.v.view(), prob.opt);
    const Reference ref = reference(c, p, prob.q, prob.k, prob.v, prob.dout);
    const double eo = error(out.o, ref.o), el = error(out.lse, ref.lse);
    const double eq = error(out.dq, ref.dq), ek = error(out.dk, ref.dk), ev = error(out.dv, ref.dv);
    // float32 accumulations over at most a few hundred terms: errors near 1e-6
    // of the largest value; a wrong mask or index gives errors of order one.
    const bool ok = eo < 2e-5 && el < 2e-5 && eq < 1e-4 && ek < 1e-4 && ev < 1e-4;
    std::printf("%s B=%d Tq=%d Tk=%d H=%d Hkv=%d D=%d causal=%d window=(%lld,%lld) layout=%d "
                "amp=%g  err o %.1e lse %.1e dq %.1e dk %.1e dv %.1e\n",
                ok ? "ok  " : "FAIL", c.B, c.Tq, c.Tk, c.H, c.Hkv, c.D, int(c.causal),
                (long long)c.left, (long long)c.right, c.layout, double(c.amp), eo, el, eq, ek,
                ev);
    CHECK(ok);
    // Rows that see no key: exactly o = 0, lse = -inf, dq = 0.
    for (size_t r = 0; r < ref.lse.size(); ++r)
        if (std::isinf(ref.lse[r])) {
            const size_t b = r / (size_t(c.H) * c.Tq), h = (r / c.Tq) % c.H, i = r % c.Tq;
            CHECK(out.lse[r] == -INFINITY);
            for (int d = 0; d < c.D; ++d) {
                const size_t at = ((b * c.Tq + i) * c.H + h) * c.D + d;
                CHECK(out.o[at] == 0.0f && out.dq[at] == 0.0f);
            }
        }
}

void check_determinism(Engine& e) {
    const Case c{2, 300, 333, 6, 2, 59, true, 100, -1, 1};
    const Problem prob(c, 77);
    const Outputs first = prob.run(e);
    CHECK(prob.run(e) == first);
    const int saved = cpu::num_threads();
    for (int threads : {1, 2, 3, 7}) {
        cpu::set_num_threads(threads);
        CHECK(cpu::num_threads() == threads);
        CHECK(prob.run(e) == first);
    }
    cpu::set_num_threads(saved);
    // Concurrent callers share the pool and still get the sequential answer.
    std::vector<Outputs> results(4);
    std::vector<std::thread> callers;
    for (size_t t = 0; t < results.size(); ++t)
        callers.emplace_back([&, t] { results[t] = prob.run(e); });
    for (auto& t : callers) t.join();
    for (const auto& r : results) CHECK(r == first);
    CHECK_THROWS(std::invalid_argument, "set_num_threads", cpu::set_num_threads(0));
    CHECK_THROWS(std::invalid_argument, "set_num_threads", cpu::set_num_threads(-3));
}

// The 16-bit bits of x's buffer (same layout), for a call in T.
template <class T>
std::vector<uint16_t> bits_of(const Array& x) {
    std::vector<uint16_t> out(x.buf.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = from_float<T>(x.buf[i]).bits;
    return out;
}

template <class T>
void round_in_place(Array& x) {
    for (float& f : x.buf) f = to_float(from_float<T>(f));
}

template <class T>
std::vector<float> widen(const std::vector<uint16_t>& bits) {
    std::vector<float> out(bits.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = to_float(T{bits[i]});
    return out;
}

// Values equal (-0 == +0: a sum may start from +0 on one path only) or both NaN.
bool same_values(const std::vector<float>& got, const std::vector<float>& want) {
    if (got.size() != want.size()) return false;
    for (size_t i = 0; i < got.size(); ++i)
        if (!(got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i])))) return false;
    return true;
}

// A call in T (Half or BFloat16) against the float32 path on the same
// values: the float32 work is the same, so each output must be the float32
// output rounded to T (the backward's float32 run takes the rounded o).
template <class T>
void check_half_case(Engine& e, const Case& c, uint32_t seed, DType dtype) {
    if (!flashattn_test::case_selected()) return;
    Problem prob(c, seed);
    for (Array* x : {&prob.q, &prob.k, &prob.v, &prob.dout}) round_in_place<T>(*x);
    auto view16 = [&](const Array& x, const std::vector<uint16_t>& bits) {
        TensorView t = x.view();
        t.data = bits.data() + x.origin;
        t.dtype = dtype;
        return t;
    };
    const auto qb = bits_of<T>(prob.q), kb = bits_of<T>(prob.k), vb = bits_of<T>(prob.v),
               db = bits_of<T>(prob.dout);
    const TensorView q16 = view16(prob.q, qb), k16 = view16(prob.k, kb), v16 = view16(prob.v, vb),
                     d16 = view16(prob.dout, db);
    // Forward in T and in float32.
    const FlashParams p = make_forward_params(q16, k16, v16, prob.opt);
    std::vector<uint16_t> o16(size_t(q_elements(p)));
    std::vector<float> lse16(size_t(lse_elements(p))), o32(o16.size()), lse32(lse16.size());
    ForwardIO io{q16.data, k16.data, v16.data, o16.data(), lse16.data()};
    io.dtype = dtype;
    run_forward(e, p, io);
    const FlashParams p32 = make_forward_params(prob.q.view(), prob.k.view(), prob.v.view(), prob.opt);
    run_forward(e, p32, {prob.q.data(), prob.k.data(), prob.v.data(), o32.data(), lse32.data()});
    std::vector<float> o32_rounded(o32.size());
    for (size_t i = 0; i < o32.size(); ++i) o32_rounded[i] = to_float(from_float<T>(o32[i]));
    const std::vector<float> o_wide = widen<T>(o16);
    const bool fwd_ok = same_values(o_wide, o32_rounded) && same_values(lse16, lse32);
    // Backward in T, and in float32 from the rounded o.
    const TensorView o16_view{o16.data(), {c.B, c.Tq, c.H, c.D},
                              {int64_t(c.Tq) * c.H * c.D, int64_t(c.H) * c.D, c.D, 1}, dtype};
    const TensorView lse_view{lse16.data(), {c.B, c.H, c.Tq}, {int64_t(c.H) * c.Tq, c.Tq, 1}};
    const FlashParams pb = make_backward_params(d16, q16, k16, v16, o16_view, lse_view, prob.opt);
    std::vector<uint16_t> dq16(size_t(q_elements(pb))), dk16(size_t(kv_elements(pb))),
        dv16(dk16.size());
    BackwardIO bio{d16.data,   q16.data,    k16.data,    v16.data,   o16.data(),
                   lse16.data(), dq16.data(), dk16.data(), dv16.data()};
    bio.dtype = dtype;
    run_backward(e, pb, bio);
    const FlashParams pb32 = make_backward_params(
        prob.dout.view(), prob.q.view(), prob.k.view(), prob.v.view(),
        contiguous_view(o_wide, c.B, c.Tq, c.H, c.D), lse_view, prob.opt);
    std::vector<float> dq32(dq16.size()), dk32(dk16.size()), dv32(dv16.size());
    run_backward(e, pb32, {prob.dout.data(), prob.q.data(), prob.k.data(), prob.v.data(),
                           o_wide.data(), lse16.data(), dq32.data(), dk32.data(), dv32.data()});
    auto rounded = [](const std::vector<float>& x) {
        std::vector<float> r(x.size());
        for (size_t i = 0; i < x.size(); ++i) r[i] = to_float(from_float<T>(x[i]));
        return r;
    };
    const bool bwd_ok = same_values(widen<T>(dq16), rounded(dq32)) &&
                        same_values(widen<T>(dk16), rounded(dk32)) &&
                        same_values(widen<T>(dv16), rounded(dv32));
    std::printf("%s %s B=%d Tq=%d Tk=%d H=%d Hkv=%d D=%d causal=%d layout=%d: forward %s, "
                "backward %s (the float32 path's results, rounded)\n",
                fwd_ok && bwd_ok ? "ok  " : "FAIL", dtype_name(dtype), c.B, c.Tq, c.Tk, c.H,
                c.Hkv, c.D, int(c.causal), c.layout, fwd_ok ? "equal" : "DIFFERENT",
                bwd_ok ? "equal" : "DIFFERENT");
    CHECK(fwd_ok && bwd_ok);
}

}  // namespace

// softcap's tanh (cpu/score_mods.h) on this path, read off lse: a row with
// one key has lse = its score, softcap * tanh(q * k / softcap) exactly (the
// log of a weight of 1 is 0). Scores from 1e-30 to 1e6 and both signs,
// against tanh in double: within 8 ulps (the fit's 6, and the scaling), and
// the sign and the cap exact.
void check_softcap_tanh(Engine& e) {
    const int64_t n = 4000;
    std::vector<float> q(n), one(1, 1.0f), o(n), lse(n);
    for (int64_t i = 0; i < n; ++i) {
        const double x = std::pow(10.0, -30.0 + 36.0 * double(i / 2) / double(n / 2));
        q[i] = float(i % 2 ? -x : x);
    }
    const TensorView qv{q.data(), {1, n, 1, 1}, {n, 1, 1, 1}};
    const TensorView kv{one.data(), {1, 1, 1, 1}, {1, 1, 1, 1}};
    AttentionOptions opt;
    opt.scale = 1.0;
    for (const double softcap : {1.0, 30.0, 1e-3}) {
        FlashParams p = make_forward_params(qv, kv, kv, opt);
        ScoreOptions so;
        so.softcap = softcap;
        const ScoreInputs score = make_score_inputs("attention", p, so);
        run_forward(e, p, {q.data(), one.data(), one.data(), o.data(), lse.data(), score});
        double worst = 0;
        for (int64_t i = 0; i < n; ++i) {
            const float c = float(softcap);
            const double want = double(c) * std::tanh(double(q[i]) / double(c));
            const double ulp = std::nextafter(std::abs(float(want)), INFINITY) - std::abs(float(want));
            worst = std::max(worst, std::abs(lse[i] - want) / ulp);
            CHECK(std::signbit(lse[i]) == std::signbit(q[i]));
            CHECK(std::abs(lse[i]) <= c * (1.0f + 4e-7f));
        }
        std::printf("  softcap %g: tanh within %.2f ulps\n", softcap, worst);
        CHECK(worst <= 8.0);
    }
    // A denormal softcap: 1 / softcap overflows, and a zero score must still be 0, not NaN.
    std::vector<float> q3 = {0.0f, 1.0f, -2.0f}, o3(3), lse3(3);
    const TensorView q3v{q3.data(), {1, 3, 1, 1}, {3, 1, 1, 1}};
    FlashParams p = make_forward_params(q3v, kv, kv, opt);
    ScoreOptions so;
    so.softcap = 1e-45;
    const ScoreInputs score = make_score_inputs("attention", p, so);
    run_forward(e, p, {q3.data(), one.data(), one.data(), o3.data(), lse3.data(), score});
    const float c = float(so.softcap);
    CHECK(lse3[0] == 0.0f && lse3[1] == c && lse3[2] == -c);
}

// A variable-length batch in one engine call (core/varlen.h) into outputs
// filled with NaN: each sequence's rows must be what the reference gives
// for its own B = 1 call, so every row is written -- the keys of a sequence
// without queries and the keys no query sees (the window) at exactly 0,
// which the call no longer clears first.
void check_varlen(Engine& e) {
    if (!flashattn_test::case_selected()) return;
    const std::vector<int> lens_q{5, 0, 3, 40, 2, 1}, lens_k{5, 7, 30, 40, 0, 9};
    const int H = 4, Hkv = 2, D = 24;
    const int64_t n = int64_t(lens_q.size());
    std::vector<int32_t> cu_q{0}, cu_k{0};
    for (int64_t b = 0; b < n; ++b) {
        cu_q.push_back(cu_q.back() + lens_q[size_t(b)]);
        cu_k.push_back(cu_k.back() + lens_k[size_t(b)]);
    }
    const int64_t tq = cu_q.back(), tk = cu_k.back();
    // Causal with a window of 4 keys to the left: a sequence of 3 queries
    // against 30 keys sees only keys 25..29.
    std::vector<Case> cases;
    std::vector<Problem> probs;
    for (int64_t b = 0; b < n; ++b) {
        cases.push_back(Case{1, lens_q[size_t(b)], lens_k[size_t(b)], H, Hkv, D, true, 4});
        probs.emplace_back(cases.back(), uint32_t(700 + b));
    }
    // The packed (total, heads, D) arrays: each sequence's rows in turn.
    auto packed = [&](const Array Problem::*a, int64_t total, int heads) {
        std::vector<float> x;
        x.reserve(size_t(total * heads * D));
        for (const Problem& pr : probs) {
            const Array& y = pr.*a;
            x.insert(x.end(), y.buf.begin(), y.buf.begin() + y.T * heads * D);
        }
        return x;
    };
    const std::vector<float> q = packed(&Problem::q, tq, H), k = packed(&Problem::k, tk, Hkv),
                             v = packed(&Problem::v, tk, Hkv), dout = packed(&Problem::dout, tq, H);
    auto view = [&](const std::vector<float>& x, int64_t rows, int heads) {
        return TensorView{x.data(), {rows, heads, D}, {int64_t(heads) * D, D, 1}};
    };
    const Sequences seqs =
        make_sequences("test", cu_q.data(), n + 1, cu_k.data(), n + 1, tq, tk);
    AttentionOptions opt = probs[0].opt;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> o(size_t(tq * H * D), nan), lse(size_t(H * tq), nan);
    std::vector<float> dq(o.size(), nan), dk(size_t(tk * Hkv * D), nan), dv(dk.size(), nan);
    run_forward_varlen(e, seqs, view(q, tq, H), view(k, tk, Hkv), view(v, tk, Hkv), opt, {},
                       o.data(), lse.data());
    run_backward_varlen(e, seqs, view(dout, tq, H), view(q, tq, H), view(k, tk, Hkv),
                        view(v, tk, Hkv), view(o, tq, H), lse.data(), opt, {}, dq.data(),
                        dk.data(), dv.data(), nullptr);
    for (int64_t b = 0; b < n; ++b) {
        const Problem& pr = probs[size_t(b)];
        const FlashParams p = make_forward_params(pr.q.view(), pr.k.view(), pr.v.view(), pr.opt);
        const Reference ref = reference(pr.c, p, pr.q, pr.k, pr.v, pr.dout);
        auto rows = [&](const std::vector<float>& x, int64_t r0, int64_t count, int heads) {
            return std::vector<float>(x.begin() + r0 * heads * D,
                                      x.begin() + (r0 + count) * heads * D);
        };
        std::vector<float> seq_lse;
        for (int h = 0; h < H; ++h)
            for (int64_t i = 0; i < pr.c.Tq; ++i) seq_lse.push_back(lse[size_t(h * tq + cu_q[b] + i)]);
        const double eo = error(rows(o, cu_q[b], pr.c.Tq, H), ref.o);
        const double el = error(seq_lse, ref.lse);
        const double eq = error(rows(dq, cu_q[b], pr.c.Tq, H), ref.dq);
        const double ek = error(rows(dk, cu_k[b], pr.c.Tk, Hkv), ref.dk);
        const double ev = error(rows(dv, cu_k[b], pr.c.Tk, Hkv), ref.dv);
        const bool ok = eo < 2e-5 && el < 2e-5 && eq < 1e-4 && ek < 1e-4 && ev < 1e-4;
        std::printf("%s varlen sequence %lld: Tq=%d Tk=%d  err o %.1e lse %.1e dq %.1e dk %.1e "
                    "dv %.1e\n",
                    ok ? "ok  " : "FAIL", (long long)b, pr.c.Tq, pr.c.Tk, eo, el, eq, ek, ev);
        CHECK(ok);
        // Keys no query of the sequence sees: exactly 0 (error() allows 1e-4).
        for (int64_t j = 0; j < pr.c.Tk; ++j)
            for (int64_t x = 0; x < Hkv * D; ++x) {
                const size_t at = size_t(j * Hkv * D + x);
                if (ref.dk[at] == 0.0 && ref.dv[at] == 0.0)
                    CHECK(dk[size_t(cu_k[b] * Hkv * D) + at] == 0.0f &&
                          dv[size_t(cu_k[b] * Hkv * D) + at] == 0.0f);
            }
    }
}

int main() {
    // The half-precision cases hold the float16 and bfloat16 paths to the
    // float32 path's results, rounded: true where they convert and compute
    // in float32, not where bfloat16 products run on AMX (cpu/amx.h, which
    // rounds P and splits P and dS). So this program runs with AMX off; the
    // Python suite holds the AMX path to the float64 reference (its
    // accuracy rule) on every test, and test_cpu_dispatch.py compares both.
    setenv("FLASHATTN_CPU_AMX", "0", 1);
    // ctest runs this once per compiled instruction set (FLASHATTN_CPU_ISA);
    // one this CPU cannot run is a skip (77), said out loud.
    try {
        std::printf("test_cpu_engine: path %s\n", cpu::active_isa().c_str());
    } catch (const std::runtime_error& e) {
        std::printf("test_cpu_engine: SKIPPED: %s\n", e.what());
        return 77;
    }
    auto engine = make_cpu_engine();
    CHECK(engine->name() == "cpu");
    const std::vector<Case> cases = {
        // B, Tq, Tk, H, Hkv, D, causal, left, right, layout
        {1, 100, 100, 2, 2, 64, false},
        {1, 100, 100, 2, 2, 64, true},
        {2, 113, 203, 4, 2, 59, true},      // Tq < Tk, GQA
        {2, 113, 203, 4, 2, 59, false},
        {1, 203, 113, 3, 1, 64, true},      // Tq > Tk: first 90 rows see no key; MQA
        {1, 203, 113, 2, 2, 111, false},
        {2, 1, 150, 4, 4, 64, true},        // decoding: one query against a cache
        {1, 1, 1, 1, 1, 1, false},
        {1, 70, 70, 2, 1, 1, true},         // D = 1
        {1, 130, 140, 2, 1, 256, true},     // D = 256
        {1, 97, 97, 2, 2, 111, false, 0, 0, 0},   // each row sees only itself
        {1, 150, 150, 4, 2, 64, true, 31, -1, 0}, // sliding window, causal
        {1, 150, 150, 2, 2, 64, false, 17, 9, 0}, // two-sided window
        {1, 140, 200, 2, 2, 64, false, 5, -1, 0}, // left window only, Tq < Tk
        {1, 200, 90, 2, 1, 59, false, 3, 2, 0},   // window with Tq > Tk: masked rows
        {2, 129, 129, 4, 2, 64, true, -1, -1, 1}, // padded strides
        {1, 111, 77, 2, 2, 59, false, 10, 20, 1},
        {2, 100, 130, 4, 1, 64, true, -1, -1, 2}, // negative time stride
        {1, 65, 300, 8, 2, 128, true, 200, -1, 2},
        {3, 64, 64, 2, 2, 32, false, -1, 3, 0},
        // Scores of magnitude ~100: running maxima jump between key blocks.
        {1, 150, 400, 2, 1, 64, false, -1, -1, 0, 4.0f},
        {1, 300, 300, 2, 2, 48, true, -1, -1, 1, 3.0f},
        {1, 200, 200, 2, 2, 64, false, -1, -1, 0, 0.05f},  // nearly uniform attention
        // MQA whose per-head dK/dV partials pass the budget: 2 heads a task.
        {1, 64, 4096, 8, 1, 256, false},
    };
    uint32_t seed = 1;
    for (const Case& c : cases) check_case(*engine, c, seed += 10);
    check_determinism(*engine);
    // float16 and bfloat16: vector loads and their scalar tails (D = 59,
    // 111), padded and reversed strides, split-KV (Tq = 1 against 2000 keys),
    // GQA with the dK/dV partials, rows that see no key.
    const std::vector<Case> half_cases = {
        {2, 113, 203, 4, 2, 59, true},
        {1, 203, 113, 3, 1, 64, true},
        {2, 129, 129, 4, 2, 64, true, -1, -1, 1},
        {2, 100, 130, 4, 1, 111, false, -1, -1, 2},
        {1, 1, 2000, 8, 2, 64, false},
        {1, 64, 64, 4, 1, 256, true, 20, -1, 0},
    };
    for (const Case& c : half_cases) {
        check_half_case<Half>(*engine, c, seed += 10, DType::f16);
        check_half_case<BFloat16>(*engine, c, seed += 10, DType::bf16);
    }
    check_softcap_tanh(*engine);
    check_varlen(*engine);
    return flashattn_test::finish("test_cpu_engine");
}
