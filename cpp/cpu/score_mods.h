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

// tanh to about 4 ulps (|error| < 1.3e-7) with one division: near 0,
// Eigen's rational fit (the exponential form cancels there); beyond,
// (e - 1) / (e + 1) with e = exp(2|x|), |x| capped at 9 where tanh rounds
// to 1 (and inf / inf would be NaN). NaN passes through (min keeps it).
inline vf tanh(vf x) {
    const vf ax = simd::select(x < simd::splat(0.0f), -x, x);
    const vi small = ax < simd::splat(0.625f);
    const vf x2 = ax * ax;
    vf num = simd::fma(x2, simd::splat(-2.76076847742355e-16f), simd::splat(2.00018790482477e-13f));
    num = simd::fma(x2, num, simd::splat(-8.60467152213735e-11f));
    num = simd::fma(x2, num, simd::splat(5.12229709037114e-08f));
    num = simd::fma(x2, num, simd::splat(1.48572235717979e-05f));
    num = simd::fma(x2, num, simd::splat(6.37261928875436e-04f));
    num = simd::fma(x2, num, simd::splat(4.89352455891786e-03f));
    num = ax * num;
    vf den = simd::fma(x2, simd::splat(1.19825839466702e-06f), simd::splat(1.18534705686654e-04f));
    den = simd::fma(x2, den, simd::splat(2.26843463243900e-03f));
    den = simd::fma(x2, den, simd::splat(4.89352518554385e-03f));
    const vf e = simd::exp2(simd::min(simd::splat(9.0f), ax) * simd::splat(2.0f * kLog2e));
    const vf t = simd::select(small, num, e - simd::splat(1.0f)) /
                 simd::select(small, den, e + simd::splat(1.0f));
    // The sign of x back on.
    return simd::bits_to_float(simd::float_to_bits(t) |
                               (simd::float_to_bits(x) & (vi{} + int32_t(0x80000000u))));
}

// What happens to the scores of one (batch, head) between the gemm and the
// softmax. Score (i, j) of query row i and key j becomes
//   s = softcap * tanh(s / softcap)        (softcap > 0)
//   s = s - slope * |i + Tk - Tq - j|      (ALiBi)
//   s = s + bias(i, j)                     (the mask, as a tile of 0 / -inf / values)
struct ScoreMods {
    bool active = false;  // any of the three: else the scores pass untouched
    float softcap = 0.0f, inv_softcap = 0.0f;
    bool alibi = false;
    float neg_slope = 0.0f;
    int32_t offset = 0;  // Tk - Tq: query i sits at key position i + offset

    static ScoreMods of(const FlashParams& p, const ScoreInputs& in, int64_t b, int64_t h) {
        ScoreMods m;
        m.offset = p.Tk - p.Tq;
        if (p.score_mods & FA_SCORE_SOFTCAP)
            m.softcap = in.params.softcap, m.inv_softcap = 1.0f / in.params.softcap;
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
            const vf t = tanh(s * simd::splat(inv_softcap));
            s = simd::splat(softcap) * t;
            if (dcap) simd::store(dcap, simd::fma(-t, t, simd::splat(1.0f)));
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
