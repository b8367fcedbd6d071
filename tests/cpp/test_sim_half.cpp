// The float16 and bfloat16 instantiations of every metal-sim kernel
// (forward, split-KV merge, backward preprocess, dQ, dK/dV, every head-size
// bucket) against the float32 ones on the same inputs, rounded to the
// 16-bit type first. The 16-bit kernels multiply 16-bit operands into
// float32 accumulators (their products exact in float32), scale the product
// q.k rather than q, and round P (and bfloat16's dS) to the 16-bit type
// before their products (shaders/flash_device.h, FaPrecision): so each
// 16-bit output must be the float32 kernel's to within a few roundings of
// its type: |x16 - x32| <= 4 x (half an ulp of the type) x max |x32| over the
// array, and lse (float32 in both) within 1e-5 of max(1, |lse|). A wrong
// element size, a missing scale or a swapped operand is off by far more.
// `--quick` (and sanitizer builds) run three cases per type.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "core/params.h"
#include "core/plan.h"
#include "sim/launcher.h"

using namespace flashattn;

namespace {

uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// The 16-bit encodings, round to nearest even (NaN stays NaN).
uint16_t to_bits(float x, DType dt) {
    if (dt == DType::f16) {
        const _Float16 h = static_cast<_Float16>(x);
        uint16_t b;
        std::memcpy(&b, &h, sizeof b);
        return b;
    }
    uint32_t u = bits_of(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}
float from_bits(uint16_t b, DType dt) {
    if (dt == DType::f16) {
        _Float16 h;
        std::memcpy(&h, &b, sizeof h);
        return float(h);
    }
    return float_of(uint32_t(b) << 16);
}

struct Case {
    int B, Tq, Tk, H, Hkv, D;
    bool causal;
    int64_t left, right;
};

std::string describe(const Case& c, DType dt) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s B=%d Tq=%d Tk=%d H=%d Hkv=%d D=%d causal=%d window=(%lld,%lld)",
                  dtype_name(dt), c.B, c.Tq, c.Tk, c.H, c.Hkv, c.D, int(c.causal),
                  (long long)c.left, (long long)c.right);
    return buf;
}

// One array in both forms: 16-bit encodings and their exact float32 values.
struct Pair {
    std::vector<uint16_t> half;
    std::vector<float> full;
};
Pair make(size_t n, DType dt, std::mt19937& rng, float range) {
    std::uniform_real_distribution<float> dist(-range, range);
    Pair p;
    p.half.resize(n);
    p.full.resize(n);
    for (size_t i = 0; i < n; ++i) {
        p.half[i] = to_bits(dist(rng), dt);
        p.full[i] = from_bits(p.half[i], dt);
    }
    return p;
}

void run(const Plan& plan, sim::SlotPointers slots) {
    // The score options' arrays (and the varlen table) are read only with
    // their bits set: the unused-slot buffer, as the metal host binds.
    for (Slot s : {Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs})
        slots[size_t(s)] = sim::unused_slot_buffer();
    sim::run_plan(plan, slots);
}

double half_ulp(DType dt) { return dt == DType::f16 ? 0x1p-11 : 0x1p-8; }

double g_worst = 0;  // worst |x16 - x32| / (half an ulp x magnitude), over every output

// Each 16-bit output within 4 half-ulps (of the array's magnitude) of the
// float32 kernel's output.
int mismatches(const char* what, const std::vector<uint16_t>& got, const std::vector<float>& full,
               DType dt, const std::string& label) {
    double magnitude = 0;
    for (float x : full) magnitude = std::max(magnitude, double(std::fabs(x)));
    const double unit = half_ulp(dt) * std::max(magnitude, 1e-30);
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        const double err = std::fabs(double(from_bits(got[i], dt)) - double(full[i]));
        g_worst = std::max(g_worst, err / unit);
        if (err <= 4 * unit) continue;
        if (bad++ == 0)
            std::printf("  %s: %s[%zu] = %g, float32 kernel %.9g (%.1f half-ulps of %g)\n",
                        label.c_str(), what, i, double(from_bits(got[i], dt)), double(full[i]),
                        err / unit, magnitude);
    }
    if (bad) std::printf("  %s: %s: %d of %zu elements off\n", label.c_str(), what, bad, got.size());
    return bad;
}

int lse_mismatches(const std::vector<float>& got, const std::vector<float>& full,
                   const std::string& label) {
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isinf(full[i]) && got[i] == full[i]) continue;
        if (std::fabs(got[i] - full[i]) <= 1e-5 * std::max(1.0f, std::fabs(full[i]))) continue;
        if (bad++ == 0)
            std::printf("  %s: lse[%zu] = %.9g, float32 kernel %.9g\n", label.c_str(), i,
                        double(got[i]), double(full[i]));
    }
    return bad;
}

int g_cases = 0;

void run_case(const Case& c, DType dt, uint32_t seed) {
    std::mt19937 rng(seed);
    const size_t nq = size_t(c.B) * c.Tq * c.H * c.D, nk = size_t(c.B) * c.Tk * c.Hkv * c.D;
    const size_t nl = size_t(c.B) * c.H * c.Tq;
    // Scores of a few units, so the softmax is neither flat nor one-hot.
    const Pair q = make(nq, dt, rng, 2.0f), k = make(nk, dt, rng, 2.0f), v = make(nk, dt, rng, 1.0f);
    const Pair dout = make(nq, dt, rng, 1.0f);
    const std::vector<int64_t> qs = {c.Tq * c.H * c.D, c.H * c.D, c.D, 1};
    const std::vector<int64_t> ks = {c.Tk * c.Hkv * c.D, c.Hkv * c.D, c.D, 1};
    const TensorView qv{q.full.data(), {c.B, c.Tq, c.H, c.D}, qs};
    const TensorView kv{k.full.data(), {c.B, c.Tk, c.Hkv, c.D}, ks};
    AttentionOptions opt;
    opt.causal = c.causal;
    opt.window_left = c.left;
    opt.window_right = c.right;
    const FlashParams pf = make_forward_params(qv, kv, kv, opt);
    const std::string label = describe(c, dt);
    const float nan = std::numeric_limits<float>::quiet_NaN();

    // Forward, float32 and 16-bit.
    std::vector<float> o32(nq, nan), lse32(nl, nan), lse16(nl, nan);
    std::vector<uint16_t> o16(nq, 0x7fff);
    sim::SlotPointers s32{}, s16{};
    s32[size_t(Slot::q)] = const_cast<float*>(q.full.data());
    s32[size_t(Slot::k)] = const_cast<float*>(k.full.data());
    s32[size_t(Slot::v)] = const_cast<float*>(v.full.data());
    s32[size_t(Slot::o)] = o32.data();
    s32[size_t(Slot::lse)] = lse32.data();
    s16[size_t(Slot::q)] = const_cast<uint16_t*>(q.half.data());
    s16[size_t(Slot::k)] = const_cast<uint16_t*>(k.half.data());
    s16[size_t(Slot::v)] = const_cast<uint16_t*>(v.half.data());
    s16[size_t(Slot::o)] = o16.data();
    s16[size_t(Slot::lse)] = lse16.data();
    const Plan f32 = plan_forward(pf, DType::f32), f16 = plan_forward(pf, dt);
    CHECK(f16.launches.size() == f32.launches.size());
    CHECK(f16.launches[0].kernel.find(std::string("_") + kernel_dtype(dt) + "_hd") != std::string::npos);
    run(f32, s32);
    run(f16, s16);
    int bad = mismatches("o", o16, o32, dt, label);
    bad += lse_mismatches(lse16, lse32, label);

    // Backward from the 16-bit forward's o (its float32 values for the
    // float32 kernels), so both compute the same delta.
    std::vector<float> o_full(nq);
    for (size_t i = 0; i < nq; ++i) o_full[i] = from_bits(o16[i], dt);
    std::vector<float> dq32(nq, nan), dk32(nk, nan), dv32(nk, nan);
    std::vector<uint16_t> dq16(nq, 0x7fff), dk16(nk, 0x7fff), dv16(nk, 0x7fff);
    FlashParams pb = pf;
    pb.dout = pb.q;
    pb.o = pb.q;
    s32[size_t(Slot::dout)] = const_cast<float*>(dout.full.data());
    s32[size_t(Slot::o)] = o_full.data();
    s32[size_t(Slot::dq)] = dq32.data();
    s32[size_t(Slot::dk)] = dk32.data();
    s32[size_t(Slot::dv)] = dv32.data();
    s16[size_t(Slot::dout)] = const_cast<uint16_t*>(dout.half.data());
    s16[size_t(Slot::lse)] = lse32.data();
    s16[size_t(Slot::dq)] = dq16.data();
    s16[size_t(Slot::dk)] = dk16.data();
    s16[size_t(Slot::dv)] = dv16.data();
    run(plan_backward(pb, DType::f32), s32);
    run(plan_backward(pb, dt), s16);
    bad += mismatches("dq", dq16, dq32, dt, label);
    bad += mismatches("dk", dk16, dk32, dt, label);
    bad += mismatches("dv", dv16, dv32, dt, label);
    CHECK(bad == 0);
    ++g_cases;
}

}  // namespace

int main(int argc, char** argv) {
    // Sanitizer builds run every GPU thread as a std::thread under the
    // sanitizer: the quick set keeps them in budget (as test_sim_kernels).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    const bool quick = true;
    (void)argc, (void)argv;
#else
    const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
#endif
    std::vector<Case> cases = {
        {1, 40, 40, 2, 1, 32, true, -1, -1},    // hd32, GQA, causal
        {1, 33, 47, 2, 2, 59, false, -1, -1},   // hd64 with column guards (D % 4 != 0)
        {1, 37, 29, 1, 1, 64, true, -1, -1},    // Tq > Tk causal: rows that see no key
        {1, 1, 600, 4, 2, 64, false, -1, -1},   // decode: split-KV, partials and the merge
        {1, 35, 35, 1, 1, 96, true, 7, 0},      // hd96, sliding window
        {1, 24, 40, 2, 1, 128, false, -1, -1},  // hd128: dK/dV in column chunks
        {1, 17, 21, 1, 1, 256, true, -1, -1},   // hd256: every kernel in column chunks
        {2, 20, 20, 1, 1, 17, false, 3, 5},     // hd32 with D = 17, two-sided window
    };
    if (quick) cases.resize(3);
    uint32_t seed = 15;
    for (DType dt : {DType::f16, DType::bf16})
        for (const Case& c : cases) run_case(c, dt, seed++);
    std::printf("%d cases (float16 and bfloat16) compared with the float32 kernels; worst "
                "difference %.2f half-ulps of the output's magnitude (limit 4)\n", g_cases, g_worst);
    return flashattn_test::finish("test_sim_half");
}
