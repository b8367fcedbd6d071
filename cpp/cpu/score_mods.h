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

#include <algorithm>
#include <cstdint>
#include <limits>

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

using simd::vi;

// a / b for finite b >= 1: on x86 the hardware's reciprocal estimate r
// (14 bits on AVX-512, 12 on AVX2) and one correction of the quotient,
// a r + r (a - b (a r)) (about 1 ulp), where a division would cost several
// times the rest of the softcap.
inline vf divide(vf a, vf b) {
#if defined(FLASHATTN_SIMD_AVX512)
    const vf r = _mm512_rcp14_ps(b);
#elif defined(FLASHATTN_SIMD_AVX2)
    vf r = _mm256_rcp_ps(b);
    r = r * simd::fma(-b, r, simd::splat(2.0f));  // 12 bits are too few for one correction
#else
    return a / b;
#endif
#if defined(FLASHATTN_SIMD_AVX512) || defined(FLASHATTN_SIMD_AVX2)
    const vf qt = a * r;
    return simd::fma(r, simd::fma(-b, qt, a), qt);
#endif
}

inline vi abs(vi d) {
#if defined(FLASHATTN_SIMD_AVX512)
    return (vi)_mm512_abs_epi32((__m512i)d);
#elif defined(FLASHATTN_SIMD_AVX2)
    return (vi)_mm256_abs_epi32((__m256i)d);
#else
    const vi sign = d >> 31;
    return (d ^ sign) - sign;
#endif
}

// tanh(x) to about 6 ulps (|relative error| < 3.3e-7), as x P(x^2) / Q(x^2)
// with x clamped to [-9, 9], beyond which tanh is 1 in float: P and Q of
// degree 4, the minimax fit of tanh's relative error on [0, 9] (a
// differential-correction fit in float64, coefficients rounded to float).
// Eight fmas and one division, where exp-based forms need an exponential,
// its range reduction and a division, and lose tanh's relative accuracy
// near 0 unless they use expm1. Odd, so the sign of x (and of 0) is kept;
// NaN stays NaN (min and max return their second operand, x, for it).
inline vf tanh(vf x) {
#if defined(FLASHATTN_SIMD_AVX512)
    x = _mm512_range_ps(x, simd::splat(9.0f), 0x2);  // min(|x|, 9), x's sign; NaN stays
#else
    x = simd::min(simd::splat(9.0f), simd::max(simd::splat(-9.0f), x));
#endif
    const vf u = x * x;
    vf p = simd::splat(1.3354153e-8f);
    p = simd::fma(p, u, simd::splat(2.0608701e-5f));
    p = simd::fma(p, u, simd::splat(3.4955644e-3f));
    p = simd::fma(p, u, simd::splat(1.3381005e-1f));
    p = simd::fma(p, u, simd::splat(9.9999998e-1f));
    vf q = simd::splat(7.7763460e-7f);
    q = simd::fma(q, u, simd::splat(3.2855964e-4f));
    q = simd::fma(q, u, simd::splat(2.5876891e-2f));
    q = simd::fma(q, u, simd::splat(4.6714321e-1f));
    q = simd::fma(q, u, simd::splat(1.0f));
    return divide(x * p, q);  // q >= 1
}

// What happens to the scores of one (batch, head) between the gemm and the
// softmax. Score (i, j) of query row i and key j becomes
//   s = softcap * tanh(s / softcap)        (softcap > 0)
//   s = s - slope * |i + Tk - Tq - j|      (ALiBi)
//   s = s + bias(i, j)                     (the mask, as a tile of 0 / -inf / values;
//                                           -inf where it is -inf, whatever s)
struct ScoreMods {
    bool active = false;  // any of the three: else the scores pass untouched
    float softcap = 0.0f, inv_softcap = 0.0f;
    bool alibi = false;
    float neg_slope = 0.0f;
    int32_t offset = 0;  // Tk - Tq: query i sits at key position i + offset

    static ScoreMods of(const FlashParams& p, const ScoreInputs& in, int64_t b, int64_t h) {
        ScoreMods m;
        m.offset = p.Tk - p.Tq;
        // (1 / softcap is capped so that a denormal softcap cannot make
        // 0 * inf = NaN of a zero score.)
        if (p.score_mods & FA_SCORE_SOFTCAP)
            m.softcap = in.params.softcap,
            m.inv_softcap = std::min(1.0f / in.params.softcap, std::numeric_limits<float>::max());
        if (p.score_mods & FA_SCORE_ALIBI)
            m.alibi = true, m.neg_slope = -in.alibi_slopes[b * in.params.alibi_b + h];
        m.active = (p.score_mods & (FA_SCORE_SOFTCAP | FA_SCORE_ALIBI | FA_SCORE_MASK_BOOL |
                                    FA_SCORE_MASK_FLOAT)) != 0;
        return m;
    }

    // The options on an MR x NV register block of scores, one option at a
    // time over the whole block (a test per block, not per vector). The
    // forward (rows: keys, lanes: queries) and the backward (rows: queries,
    // lanes: keys) both number the block so that lane l of c[r][v] has
    // |p - j| = |base + v W + l - r|. bias: the mask entries, c[r][v]'s at
    // bias + r ld + v W, or null; dcap (backward): where
    // d(softcap tanh(s / softcap))/ds = 1 - tanh^2 goes, laid out like bias, or null.
    template <int MR, int NV>
    void apply(vf (&c)[MR][NV], int32_t base, const float* bias, float* dcap, int64_t ld) const {
        if (softcap > 0.0f) {
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
                for (int v = 0; v < NV; ++v) {
                    const vf t = tanh(c[r][v] * simd::splat(inv_softcap));
                    c[r][v] = t * simd::splat(softcap);
                    if (dcap) simd::store(dcap + r * ld + v * W, simd::fma(-t, t, simd::splat(1.0f)));
                }
        }
        if (alibi) {
            const vi lanes = simd::iota() + base;
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
                for (int v = 0; v < NV; ++v) {
                    const vi d = abs(lanes + (v * W - r));  // |p - j|
                    c[r][v] = simd::fma(simd::splat(neg_slope), __builtin_convertvector(d, vf),
                                        c[r][v]);
                }
        }
        if (bias) {
            // A -inf entry hides the key: the score is -inf whatever it was
            // (NaN or +inf from a k holding one included), not s + (-inf).
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
                for (int v = 0; v < NV; ++v) {
                    const vf x = simd::load(bias + r * ld + v * W);
                    c[r][v] = simd::select(x == simd::splat(-simd::kInf), x, c[r][v] + x);
                }
        }
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
