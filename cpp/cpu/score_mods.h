// The score options of issue 16 as the cpu tiles apply them: softcap, ALiBi
// and the mask change each score in registers, between the Q K^T product and
// the exponentials, in the gemm's epilogue; the forward and the backward call
// the same function, so the backward recomputes the forward's scores bit for
// bit. Plain attention skips all of it with one test per register block.
// (Sinks need no tile work: they start each row's softmax state, and their
// gradient is computed once per call in core/engine.cpp.)
#pragma once
#ifndef FLASHATTN_CPU_ISA
#error "include cpu/isa_begin.h first"
#endif

#include <cstdint>

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

using simd::vi;

// a / b for b in [1, 2] (tanh's denominator): on x86 the hardware's
// reciprocal estimate and one Newton step (about 1 ulp of 1 / b), where a
// division would cost several times the rest of the softcap.
inline vf divide_near_1(vf a, vf b) {
#if defined(FLASHATTN_SIMD_AVX512)
    vf r = _mm512_rcp14_ps(b);
#elif defined(FLASHATTN_SIMD_AVX2)
    vf r = _mm256_rcp_ps(b);
#else
    return a / b;
#endif
#if defined(FLASHATTN_SIMD_AVX512) || defined(FLASHATTN_SIMD_AVX2)
    r = r * simd::fma(-b, r, simd::splat(2.0f));  // r (2 - b r): one Newton step
    // a r, then one correction of the quotient: a r + r (a - b (a r)).
    const vf qt = a * r;
    return simd::fma(r, simd::fma(-b, qt, a), qt);
#endif
}

// softcap * tanh(s / softcap) to about 4 ulps of tanh (|error| < 1.6e-7),
// as -m / (2 + m) with m = expm1(-2|x|), x = s / softcap: one exponential
// and one division. expm1 is 2^y - 1 with y = -2|x| log2(e) split as n + f
// (|f| <= 1/2): m = 2^n (2^f - 1) + (2^n - 1), and 2^f - 1 is the
// polynomial of simd::exp2_poly without its constant 1, so m keeps its
// relative accuracy as x goes to 0 (no 1 - e cancels). y is capped at -60,
// where tanh is 1 in float; a NaN passes the cap (max returns its second
// operand then) and stays NaN. k = 2 log2(e) / softcap.
inline vf softcap_tanh(vf s, float softcap, float k) {
    const vi sign = simd::float_to_bits(s) & (vi{} + int32_t(0x80000000u));
    const vf y = simd::max(simd::splat(-60.0f),
                           simd::bits_to_float(simd::float_to_bits(s * simd::splat(k)) |
                                               (vi{} + int32_t(0x80000000u))));  // -|x| 2 log2(e)
    // Adding 1.5 * 2^23 rounds y to the integer n, which lands in t's low bits.
    const vf magic = simd::splat(12582912.0f);
    const vf t = y + magic;
    const vf f = y - (t - magic);
    vf q = simd::splat(1.5337585e-4f);
    q = simd::fma(q, f, simd::splat(1.3399870e-3f));
    q = simd::fma(q, f, simd::splat(9.6185198e-3f));
    q = simd::fma(q, f, simd::splat(5.5503290e-2f));
    q = simd::fma(q, f, simd::splat(2.4022646e-1f));
    q = simd::fma(q, f, simd::splat(6.9314718e-1f));
    q = q * f;  // 2^f - 1
    const vf scale = simd::bits_to_float(
        ((simd::float_to_bits(t) - simd::float_to_bits(magic)) + 127) << 23);  // 2^n
    const vf m = simd::fma(scale, q, scale - simd::splat(1.0f));
    const vf th = divide_near_1(-m, simd::splat(2.0f) + m);  // 2 + m is in (1, 2]
    return simd::bits_to_float(simd::float_to_bits(th * simd::splat(softcap)) | sign);
}

// What happens to the scores of one (batch, head) between the gemm and the
// softmax. Score (i, j) of query row i and key j becomes
//   s = softcap * tanh(s / softcap)        (softcap > 0)
//   s = s - slope * |i + Tk - Tq - j|      (ALiBi)
//   s = s + bias(i, j)                     (the mask, as a tile of 0 / -inf / values)
struct ScoreMods {
    bool active = false;  // any of the three: else the scores pass untouched
    float softcap = 0.0f, softcap_k = 0.0f;  // softcap_k = 2 log2(e) / softcap
    bool alibi = false;
    float neg_slope = 0.0f;
    int32_t offset = 0;  // Tk - Tq: query i sits at key position i + offset

    static ScoreMods of(const FlashParams& p, const ScoreInputs& in, int64_t b, int64_t h) {
        ScoreMods m;
        m.offset = p.Tk - p.Tq;
        if (p.score_mods & FA_SCORE_SOFTCAP)
            m.softcap = in.params.softcap, m.softcap_k = 2.0f * kLog2e / in.params.softcap;
        if (p.score_mods & FA_SCORE_ALIBI)
            m.alibi = true, m.neg_slope = -in.alibi_slopes[b * in.params.alibi_b + h];
        m.active = (p.score_mods & (FA_SCORE_SOFTCAP | FA_SCORE_ALIBI | FA_SCORE_MASK_BOOL |
                                    FA_SCORE_MASK_FLOAT)) != 0;
        return m;
    }

    // W scores whose lanes have p - j = diff; bias: W mask entries or null;
    // dcap (backward): where d(softcap(s))/ds goes, or null.
    vf apply(vf s, simd::vi diff, const float* bias, float* dcap) const {
        if (softcap > 0.0f) {
            s = softcap_tanh(s, softcap, softcap_k);
            if (dcap) {  // d/ds softcap tanh(s / softcap) = 1 - tanh^2
                const vf t = s * simd::splat(1.0f / softcap);
                simd::store(dcap, simd::fma(-t, t, simd::splat(1.0f)));
            }
        }
        if (alibi) {
            const vf d = __builtin_convertvector(diff, vf);
            const vf dist = simd::select(d < simd::splat(0.0f), -d, d);
            s = simd::fma(simd::splat(neg_slope), dist, s);
        }
        if (bias) s += simd::load(bias);
        return s;
    }
};

// The mask over a tile as additive values in `tile`: 0 where a bool mask is
// true, -inf where false, a float mask's own values. Query rows [i0, i0 + nq)
// and keys [j0, j0 + nk); element (r, j) at tile[j * ld + r] when keys_major
// (the forward's S^T) else tile[r * ld + j]; the padding up to `pad` rows
// (forward) or columns (backward) is 0. The mask is read in place through its
// strides. Returns false when every entry is hidden: the tile can be skipped.
inline bool mask_tile(const FlashParams& p, const ScoreInputs& in, int64_t b, int64_t h,
                      int64_t i0, int nq, int64_t j0, int nk, bool keys_major, float* tile,
                      int64_t ld, int pad) {
    const FlashScoreParams& sp = in.params;
    const int64_t base = b * sp.mask_b + h * sp.mask_h + i0 * sp.mask_i + j0 * sp.mask_j;
    const int64_t si = keys_major ? 1 : ld, sj = keys_major ? ld : 1;
    bool any = false;
    if (p.score_mods & FA_SCORE_MASK_BOOL) {
        const uint8_t* m = static_cast<const uint8_t*>(in.mask) + base;
        for (int r = 0; r < nq; ++r)
            for (int j = 0; j < nk; ++j) {
                const bool on = m[r * sp.mask_i + j * sp.mask_j] != 0;
                any |= on;
                tile[r * si + j * sj] = on ? 0.0f : -simd::kInf;
            }
    } else {
        const float* m = static_cast<const float*>(in.mask) + base;
        for (int r = 0; r < nq; ++r)
            for (int j = 0; j < nk; ++j) {
                const float x = m[r * sp.mask_i + j * sp.mask_j];
                any |= x != -simd::kInf;
                tile[r * si + j * sj] = x;
            }
    }
    if (keys_major) {
        for (int j = 0; j < nk; ++j)
            for (int r = nq; r < pad; ++r) tile[j * ld + r] = 0.0f;
    } else {
        for (int r = 0; r < nq; ++r)
            for (int j = nk; j < pad; ++j) tile[r * ld + j] = 0.0f;
    }
    return any;
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
