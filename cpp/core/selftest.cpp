// The GPU engines' self-test (selftest.h): the lane probe's expected output,
// and the known-answer calls run at each pipeline's first use.
#include "core/selftest.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "core/half.h"
#include "core/params.h"
#include "core/varlen.h"
#include "metal/pipeline_key.h"

namespace flashattn {

// ---- the lane probe ----------------------------------------------------

Launch lane_probe_launch() {
    return Launch{"flash_selftest_lanes", {Slot::q, Slot::o}, Dim3{1, 1, 1}, Dim3{32, 1, 1}, {}};
}

std::vector<float> lane_probe_input() {
    std::vector<float> a(kLaneProbeInputs);
    for (int i = 0; i < kLaneProbeInputs; ++i) a[size_t(i)] = float(i + 1);  // A[r][c] = 8 r + c + 1
    return a;
}

std::string check_lane_probe(const float* out) {
    auto A = [](int r, int c) { return float(8 * r + c + 1); };
    auto differ = [](const char* what, int lane, int i, float got, float want) {
        std::ostringstream s;
        s << "lane probe: " << what << ": lane " << lane << " element " << i << " holds " << got
          << ", the layout the kernels assume (shaders/flash_device.h fa_lane) gives " << want;
        return s.str();
    };
    for (int lane = 0; lane < 32; ++lane) {
        // fa_lane, as the kernels compute it.
        const int q = lane / 4, row = (q & 4) + (lane / 2) % 4, col = (q & 2) * 2 + (lane % 2) * 2;
        for (int i = 0; i < 2; ++i) {
            if (out[lane * 2 + i] != A(row, col + i))
                return differ("simdgroup_load", lane, i, out[lane * 2 + i], A(row, col + i));
            if (out[64 + lane * 2 + i] != A(col + i, row))
                return differ("transposed simdgroup_load", lane, i, out[64 + lane * 2 + i],
                              A(col + i, row));
        }
        const float row_sum = float(64 * row + 36);
        if (out[192 + lane] != row_sum)
            return differ("row sum by shuffles (lanes ^1, ^8)", lane, 0, out[192 + lane], row_sum);
    }
    // C = A B with B[k][c] = 1 where c = (k + 3) % 8: C[r][c] = A[r][(c + 5) % 8].
    for (int r = 0; r < 8; ++r)
        for (int c = 0; c < 8; ++c)
            if (out[128 + 8 * r + c] != A(r, (c + 5) % 8)) {
                std::ostringstream s;
                s << "lane probe: simdgroup_multiply_accumulate of a matrix written through "
                     "thread_elements() at the assumed places: C["
                  << r << "][" << c << "] = " << out[128 + 8 * r + c] << ", expected "
                  << A(r, (c + 5) % 8);
                return s.str();
            }
    return {};
}

bool selftest_enabled(bool otherwise) {
    const char* env = std::getenv("FLASHATTN_METAL_SELFTEST");
    if (!env || !*env) return otherwise;
    const std::string v = env;
    if (v == "0") return false;
    if (v == "1") return true;
    throw std::invalid_argument("FLASHATTN_METAL_SELFTEST must be 0 (off) or 1 (on), got '" + v + "'");
}

// ---- the known-answer calls ---------------------------------------------

namespace {

// Re-entrance: the probe calls go through the engine's own entry points,
// which check again; on the thread running them, those checks pass.
thread_local bool tl_in_probe = false;

// Values in [lo, hi) from a fixed generator: the same probe everywhere.
struct Lcg {
    uint64_t state;
    float next(float lo, float hi) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        return lo + (hi - lo) * float((state >> 40) & 0xffffff) / 16777216.0f;
    }
};

// n elements of a dtype: float32, or float16 / bfloat16 bits.
class Array {
public:
    Array(size_t n, DType dtype) : dtype_(dtype), f32_(dtype == DType::f32 ? n : 0),
                                   bits_(dtype == DType::f32 ? 0 : n) {}
    void set(size_t i, float x) {
        if (dtype_ == DType::f32) f32_[i] = x;
        else if (dtype_ == DType::f16) bits_[i] = from_float<Half>(x).bits;
        else bits_[i] = from_float<BFloat16>(x).bits;
    }
    float get(size_t i) const {
        if (dtype_ == DType::f32) return f32_[i];
        if (dtype_ == DType::f16) return to_float(Half{bits_[i]});
        return to_float(BFloat16{bits_[i]});
    }
    void* data() { return dtype_ == DType::f32 ? static_cast<void*>(f32_.data()) : bits_.data(); }
    size_t size() const { return dtype_ == DType::f32 ? f32_.size() : bits_.size(); }

private:
    DType dtype_;
    std::vector<float> f32_;
    std::vector<uint16_t> bits_;
};

TensorView view(const void* data, std::vector<int64_t> shape, DType dtype) {
    TensorView t;
    t.data = data;
    t.dtype = dtype;
    t.shape = shape;
    t.strides.assign(shape.size(), 1);
    for (size_t a = shape.size(); a-- > 1;) t.strides[a - 1] = t.strides[a] * shape[a];
    return t;
}

// The probe calls: causal, tiny, awkward lengths; each is planned with the
// call's head size, dtype and score options, and run where its plan has a
// pipeline not tested yet. Together they reach every kernel a plan has.
struct ProbeShape {
    int B, Tq, Tk, H, Hkv;
    const char* what;
    // A varlen probe: B sequences of these lengths, packed (Tq, Tk: the totals).
    std::vector<int> lens_q = {}, lens_k = {};
};
const ProbeShape kProbes[] = {
    {1, 37, 45, 2, 1, "tiled"},             // two row blocks, several key blocks, GQA
    {1, 1, 600, 2, 1, "split-KV decode"},   // GQA: one row block, split keys and the merge
    {1, 1, 600, 2, 2, "MHA decode"},        // the vector kernel, split keys and the merge
};
// The varlen pipelines' probes: sequences longer and shorter than a block,
// one of a single query, one without queries and one without keys; then
// decode (MHA, a query or none per sequence: the vector kernel).
const ProbeShape kVarlenProbes[] = {
    {1, 50, 81, 2, 1, "varlen", {37, 1, 0, 12}, {45, 30, 6, 0}},
    {1, 3, 81, 2, 2, "varlen decode", {1, 1, 0, 1}, {45, 30, 6, 0}},
};

class Probe {
public:
    Probe(const ProbeShape& s, int D, DType dtype, int score_mods)
        : s_(s), D_(D), dtype_(dtype),
          q_(size_t(s.B) * s.Tq * s.H * D, dtype), k_(size_t(s.B) * s.Tk * s.Hkv * D, dtype),
          v_(k_.size(), dtype), dout_(q_.size(), dtype) {
        Lcg rng{0x5e1f7e57ull + uint64_t(D)};
        for (Array* a : {&q_, &k_, &v_, &dout_})
            for (size_t i = 0; i < a->size(); ++i) a->set(i, rng.next(-1.0f, 1.0f));
        options_.causal = true;
        p_ = make_forward_params(view(q_.data(), {s.B, s.Tq, s.H, D}, dtype),
                                 view(k_.data(), {s.B, s.Tk, s.Hkv, D}, dtype),
                                 view(v_.data(), {s.B, s.Tk, s.Hkv, D}, dtype), options_);
        ScoreOptions& score = score_options_;
        if (score_mods & FA_SCORE_SOFTCAP) score.softcap = 3.0;
        const int slope_rows = varlen() ? int(s.lens_q.size()) : 1;  // varlen: (batch, H)
        if (score_mods & FA_SCORE_ALIBI) {
            for (int r = 0; r < slope_rows; ++r)
                for (int h = 0; h < s.H; ++h) alibi_.push_back(0.25f / float(h + 1 + r));
            score.alibi_slopes = view(alibi_.data(), {slope_rows, s.H}, DType::f32);
        }
        const size_t mask_n = size_t(s.B) * s.H * s.Tq * s.Tk;
        if (score_mods & FA_SCORE_MASK_BOOL) {
            for (size_t i = 0; i < mask_n; ++i) mask_bool_.push_back(rng.next(0, 1) < 0.8f);
            score.mask = view(mask_bool_.data(), {s.B, s.H, s.Tq, s.Tk}, DType::f32);
            score.mask_is_bool = true;
        } else if (score_mods & FA_SCORE_MASK_FLOAT) {
            for (size_t i = 0; i < mask_n; ++i)
                mask_float_.push_back(rng.next(0, 1) < 0.1f ? -std::numeric_limits<float>::infinity()
                                                            : rng.next(-1.0f, 0.5f));
            score.mask = view(mask_float_.data(), {s.B, s.H, s.Tq, s.Tk}, DType::f32);
        }
        if (score_mods & FA_SCORE_SINKS) {
            for (int h = 0; h < s.H; ++h) sinks_.push_back(h % 2 ? -1.0f : 0.5f);
            score.sinks = view(sinks_.data(), {s.H}, DType::f32);
        }
        if (!varlen()) {
            score_ = make_score_inputs("self-test", p_, score);
            return;
        }
        std::vector<int32_t> cu_q{0}, cu_k{0};
        for (size_t b = 0; b < s.lens_q.size(); ++b) {
            cu_q.push_back(cu_q.back() + s.lens_q[b]);
            cu_k.push_back(cu_k.back() + s.lens_k[b]);
        }
        const int64_t n = int64_t(cu_q.size());
        seqs_ = make_sequences("self-test", cu_q.data(), n, cu_k.data(), n, s.Tq, s.Tk);
        p_ = make_varlen("self-test", seqs_, rows(q_, s.H), rows(k_, s.Hkv), rows(v_, s.Hkv),
                         options_, score, score_)
                 .packed;
    }

    const FlashParams& params() const { return p_; }

    std::string describe(bool backward) const {
        std::ostringstream d;
        d << (backward ? "backward" : "forward") << " of the " << s_.what << " probe call B=" << s_.B
          << " Tq=" << s_.Tq << " Tk=" << s_.Tk << " H=" << s_.H << " Hkv=" << s_.Hkv << " D=" << D_
          << " " << dtype_name(dtype_) << " causal"
          << (p_.score_mods ? " with score options " + std::to_string(p_.score_mods) : "");
        if (varlen()) {
            d << ", sequences of";
            for (size_t b = 0; b < s_.lens_q.size(); ++b)
                d << (b ? ", " : " ") << s_.lens_q[b] << "x" << s_.lens_k[b];
        }
        return d.str();
    }

    // "" when `engine` answers as `reference` does, within the bound.
    std::string run(Engine& engine, Engine& reference, bool backward) {
        const size_t nq = q_.size(), nk = k_.size(), nl = size_t(s_.B) * s_.H * s_.Tq;
        Array o_ref(nq, dtype_), o(nq, dtype_);
        std::vector<float> lse_ref(nl), lse(nl);
        forward(reference, o_ref, lse_ref);
        if (!backward) {
            forward(engine, o, lse);
            std::string e = compare("o", o, o_ref, 2.0);
            return e.empty() ? compare("lse", lse, lse_ref, 2.0) : e;
        }
        Array dq_ref(nq, dtype_), dk_ref(nk, dtype_), dv_ref(nk, dtype_);
        Array dq(nq, dtype_), dk(nk, dtype_), dv(nk, dtype_);
        this->backward(reference, o_ref, lse_ref, dq_ref, dk_ref, dv_ref);
        this->backward(engine, o_ref, lse_ref, dq, dk, dv);
        for (auto [name, got, want] : {std::tuple{"dq", &dq, &dq_ref}, std::tuple{"dk", &dk, &dk_ref},
                                       std::tuple{"dv", &dv, &dv_ref}}) {
            const std::string e = compare(name, *got, *want, 3.0);
            if (!e.empty()) return e;
        }
        return {};
    }

private:
    bool varlen() const { return !s_.lens_q.empty(); }
    // A packed array as the varlen calls take it: (total rows, heads, D).
    TensorView rows(Array& a, int heads) const {
        return view(a.data(), {int64_t(a.size()) / (int64_t(heads) * D_), heads, D_}, dtype_);
    }

    void forward(Engine& engine, Array& o, std::vector<float>& lse) {
        if (varlen()) {
            run_forward_varlen(engine, seqs_, rows(q_, s_.H), rows(k_, s_.Hkv), rows(v_, s_.Hkv),
                               options_, score_options_, o.data(), lse.data());
            return;
        }
        ForwardIO io{q_.data(), k_.data(), v_.data(), o.data(), lse.data()};
        io.score = score_;
        io.dtype = dtype_;
        run_forward(engine, p_, io);
    }
    void backward(Engine& engine, Array& o, std::vector<float>& lse, Array& dq, Array& dk,
                  Array& dv) {
        if (varlen()) {
            std::vector<float> dsinks(size_t(s_.H));
            run_backward_varlen(engine, seqs_, rows(dout_, s_.H), rows(q_, s_.H), rows(k_, s_.Hkv),
                                rows(v_, s_.Hkv), rows(o, s_.H), lse.data(), options_,
                                score_options_, dq.data(), dk.data(), dv.data(),
                                sinks_.empty() ? nullptr : dsinks.data());
            return;
        }
        BackwardIO io{dout_.data(), q_.data(), k_.data(), v_.data(), o.data(), lse.data(),
                      dq.data(),    dk.data(), dv.data()};
        io.score = score_;
        io.dtype = dtype_;
        run_backward(engine, p_, io);
    }

    double ulp() const {
        return dtype_ == DType::f16 ? std::ldexp(1.0, -10) : dtype_ == DType::bf16 ? std::ldexp(1.0, -7) : 0.0;
    }

    // The bound of selftest.h on every element of `got` against `want`.
    template <class A>
    std::string compare(const char* name, const A& got, const A& want, double factor) const {
        const size_t n = size(want);
        double m = 0;
        for (size_t i = 0; i < n; ++i)
            if (std::isfinite(at(want, i))) m = std::max(m, std::fabs(at(want, i)));
        const double terms = std::max(D_, s_.Tk);
        const double e32 = 4.0 * std::ldexp(1.0, -24) * std::sqrt(terms) * m;
        const bool is_lse = std::string(name) == "lse";
        const double bound = factor * std::max(e32, 1e-6 * m) + (is_lse ? 0.0 : ulp() * m);
        for (size_t i = 0; i < n; ++i) {
            const double g = at(got, i), w = at(want, i);
            const bool same_special = (std::isnan(g) && std::isnan(w)) || (std::isinf(w) && g == w);
            if (same_special || std::fabs(g - w) <= bound) continue;
            std::ostringstream s;
            s << name << "[" << i << "] = " << g << " where the cpu engine gives " << w
              << " (allowed difference " << bound << ")";
            return s.str();
        }
        return {};
    }
    static size_t size(const Array& a) { return a.size(); }
    static size_t size(const std::vector<float>& a) { return a.size(); }
    static double at(const Array& a, size_t i) { return a.get(i); }
    static double at(const std::vector<float>& a, size_t i) { return a[i]; }

    const ProbeShape s_;
    const int D_;
    const DType dtype_;
    Array q_, k_, v_, dout_;
    std::vector<float> alibi_, mask_float_, sinks_;
    std::vector<unsigned char> mask_bool_;
    FlashParams p_{};  // a varlen probe's: the packed call's (varlen_seqs > 0)
    AttentionOptions options_;
    ScoreOptions score_options_;
    ScoreInputs score_;
    Sequences seqs_;  // a varlen probe's
};

std::vector<std::string> pipelines(const Plan& plan) {
    std::vector<std::string> keys;
    for (const Launch& l : plan.launches)
        if (uint64_t(l.grid.x) * l.grid.y * l.grid.z > 0)
            keys.push_back(metal::pipeline_key(l.kernel, l.constants));
    return keys;
}

}  // namespace

SelfTest::SelfTest(std::string engine, GpuInfo gpu, std::function<Engine&()> reference)
    : engine_(std::move(engine)), gpu_(gpu), reference_(std::move(reference)) {}

void SelfTest::check_forward(Engine& engine, const FlashParams& call, DType dtype) {
    if (tl_in_probe) return;
    check(engine, plan_forward(call, dtype, gpu_), call, dtype, false);
}

void SelfTest::check_backward(Engine& engine, const FlashParams& call, DType dtype) {
    if (tl_in_probe) return;
    check(engine, plan_backward(call, dtype), call, dtype, true);
}

void SelfTest::check_forward_varlen(Engine& engine, const Varlen& call, DType dtype) {
    if (tl_in_probe) return;
    check(engine, plan_forward(call.packed, dtype, gpu_), call.packed, dtype, false);
}

void SelfTest::check_backward_varlen(Engine& engine, const Varlen& call, DType dtype) {
    if (tl_in_probe) return;
    check(engine, plan_backward(call.packed, dtype), call.packed, dtype, true);
}

void SelfTest::check(Engine& engine, const Plan& plan, const FlashParams& call, DType dtype,
                     bool backward) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) throw SelfTestFailed(failure_);
    std::vector<std::string> missing;
    for (const std::string& key : pipelines(plan))
        if (!passed_.count(key)) missing.push_back(key);
    if (missing.empty()) return;

    struct InProbe {
        InProbe() { tl_in_probe = true; }
        ~InProbe() { tl_in_probe = false; }
    } in_probe;
    const auto start = std::chrono::steady_clock::now();
    auto fail = [&](const std::string& why) {
        failure_ = engine_ + " engine self-test failed: " + why;
        stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        throw SelfTestFailed(failure_);
    };
    // A varlen call (call.varlen_seqs > 0) plans varlen pipelines: the
    // varlen probe reaches them, the dense ones cannot.
    const std::vector<ProbeShape> probes =
        call.varlen_seqs > 0 ? std::vector<ProbeShape>(std::begin(kVarlenProbes), std::end(kVarlenProbes))
                             : std::vector<ProbeShape>(std::begin(kProbes), std::end(kProbes));
    for (const ProbeShape& shape : probes) {
        if (missing.empty()) break;
        Probe probe(shape, call.D, dtype, call.score_mods);
        const Plan probe_plan = backward ? plan_backward(probe.params(), dtype)
                                         : plan_forward(probe.params(), dtype, gpu_);
        const std::vector<std::string> keys = pipelines(probe_plan);
        const auto target = std::find_first_of(missing.begin(), missing.end(), keys.begin(), keys.end());
        if (target == missing.end()) continue;  // it reaches nothing untested
        const std::string pipeline = *target;
        std::string error;
        try {
            error = probe.run(engine, reference_(), backward);
        } catch (const std::exception& e) {
            error = std::string("it raised: ") + e.what();
        }
        stats_.probes += 1;
        if (!error.empty())
            fail("pipeline '" + pipeline + "' (" + probe.describe(backward) + "): " + error);
        for (const std::string& k : keys) {
            if (passed_.insert(k).second) stats_.pipelines += 1;
            missing.erase(std::remove(missing.begin(), missing.end(), k), missing.end());
        }
    }
    if (!missing.empty())
        fail("no known-answer probe reaches pipeline '" + missing.front() + "'");
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string SelfTest::failure() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
}

SelfTest::Stats SelfTest::stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
}

}  // namespace flashattn
