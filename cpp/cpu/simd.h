// The vector type the cpu engine's inner loops are written in: W float lanes
// (16 with AVX-512, 8 with AVX2, 4 with NEON or the baseline), as GCC/Clang
// vector extensions so every ISA shares one source; intrinsics only where
// they beat the portable expression (fma, max, exp2 scaling). Compiled once
// per instruction set, inside the region cpu/isa_begin.h opens.
#pragma once
#ifndef FLASHATTN_CPU_ISA
#error "include cpu/isa_begin.h first"
#endif

// GCC 12 warns that the AVX-512 intrinsics' internal _mm512_undefined_ps()
// "may be used uninitialized" (or "is used uninitialized") wherever they
// inline: a known false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace flashattn::cpu::FLASHATTN_CPU_ISA::simd {

#if defined(FLASHATTN_SIMD_AVX512)
inline constexpr int W = 16;
#elif defined(FLASHATTN_SIMD_AVX2)
inline constexpr int W = 8;
#else
inline constexpr int W = 4;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline constexpr float kInf = std::numeric_limits<float>::infinity();

inline vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// (Not vf{} + x: adding +0.0 is not an identity for -0.0, so the compiler
// would keep a real add in front of every broadcast.)
inline vf splat(float x) {
#if defined(FLASHATTN_SIMD_AVX512)
    return _mm512_set1_ps(x);
#elif defined(FLASHATTN_SIMD_AVX2)
    return _mm256_set1_ps(x);
#elif defined(FLASHATTN_SIMD_NEON)
    return (vf)vdupq_n_f32(x);
#else
    return vf{x, x, x, x};
#endif
}
inline vf bits_to_float(vi x) { return (vf)x; }  // vector casts reinterpret bits
inline vi float_to_bits(vf x) { return (vi)x; }

// Lane-wise m ? a : b for a comparison result m (all ones or all zeros).
inline vf select(vi m, vf a, vf b) {
    return bits_to_float((m & float_to_bits(a)) | (~m & float_to_bits(b)));
}

inline vf fma(vf a, vf b, vf c) {
#if defined(FLASHATTN_SIMD_AVX512)
    return _mm512_fmadd_ps(a, b, c);
#elif defined(FLASHATTN_SIMD_AVX2)
    return _mm256_fmadd_ps(a, b, c);
#elif defined(FLASHATTN_SIMD_NEON)
    return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
    return a * b + c;
#endif
}

// x86's max and min: b when either is NaN. Every path keeps that rule (the
// NEON and generic ones by compare and select; vmaxq_f32 would return the
// NaN), so NaN inputs reach the same rows on every machine.
inline vf max(vf a, vf b) {
#if defined(FLASHATTN_SIMD_AVX512)
    return _mm512_max_ps(a, b);
#elif defined(FLASHATTN_SIMD_AVX2)
    return _mm256_max_ps(a, b);
#elif defined(FLASHATTN_SIMD_NEON)
    return (vf)vbslq_f32(vcgtq_f32((float32x4_t)a, (float32x4_t)b), (float32x4_t)a,
                         (float32x4_t)b);
#else
    return select(a > b, a, b);
#endif
}
inline vf min(vf a, vf b) {
#if defined(FLASHATTN_SIMD_AVX512)
    return _mm512_min_ps(a, b);
#elif defined(FLASHATTN_SIMD_AVX2)
    return _mm256_min_ps(a, b);
#elif defined(FLASHATTN_SIMD_NEON)
    return (vf)vbslq_f32(vcltq_f32((float32x4_t)a, (float32x4_t)b), (float32x4_t)a,
                         (float32x4_t)b);
#else
    return select(a < b, a, b);
#endif
}

// Lane indices 0, 1, ..., W - 1.
inline vi iota() {
    vi v;
    for (int i = 0; i < W; ++i) v[i] = i;
    return v;
}

// The lanes of index vector `index` that fall in [lo, hi), as a select mask.
inline vi in_range(vi index, int lo, int hi) {
    return (index >= (vi{} + lo)) & (index < (vi{} + hi));
}

// 2^x to under 2 ulp for floor <= x <= 127 (up to 128 it gives at most
// 2^128); exactly 0 below floor (at most -125, so never a denormal: every
// gemm use of one costs a microcode assist) and for -inf (masked scores), so
// masked entries contribute nothing. IEEE at the top: NaN stays NaN and
// x >= 128 (+inf included) gives +inf, so a NaN or inf score reaches its
// row's output instead of vanishing.
// Relative-error minimax fit of 2^f on [-0.5, 0.5], degree 5 with p(0) = 1:
// 1.7e-7 (1.4 ulp) with float32 Horner steps, where degree 6 gave 8.4e-8
// for one FMA more per exponential (the forward's exponentials took about a
// tenth of its time). (A function, not a lambda in exp2: Clang's target
// pragma skips lambdas.)
inline vf exp2_poly(vf f) {
    vf p = splat(1.3264675e-3f);
    p = fma(p, f, splat(9.6714953e-3f));
    p = fma(p, f, splat(5.5507336e-2f));
    p = fma(p, f, splat(2.4022242e-1f));
    p = fma(p, f, splat(6.9314700e-1f));
    return fma(p, f, splat(1.0f));
}

// exp2 where x <= 127 (or NaN, which stays NaN): the same values, without
// the work exp2 spends on larger x. A finite x above 127, or +inf, gives an
// unspecified value. For exponents known to stay low, such as the forward's
// score minus running max (at most 0, or at most the one-pass headroom in
// a block that is redone if any exceeds it): on AVX2 four instructions of
// exp2's nineteen fewer (the upper clamp and the final compare, add and select).
inline vf exp2_upto127(vf x, float floor = -125.0f) {
    // max keeps b when either is NaN: x second, so a NaN x stays NaN, and
    // the floor mask is "not below floor", which NaN passes.
#if defined(FLASHATTN_SIMD_AVX512)
    // p * 2^n by scalef, 0 below the floor (scalef alone would give
    // denormals: they made ALiBi, whose far keys weigh next to nothing, 3x
    // slower).
    x = max(splat(-160.0f), x);
    const vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, splat(floor), _CMP_NLT_UQ),
                                  exp2_poly(x - n), n);
#else
    x = max(splat(-127.0f), x);
#if defined(FLASHATTN_SIMD_NEON)
    // Round to nearest (even), then n goes into p's exponent (a NaN
    // converts to 0).
    const vf n = (vf)vrndnq_f32((float32x4_t)x);
    const vi e = (vi)vshlq_n_s32(vcvtq_s32_f32((float32x4_t)n), 23);
#elif defined(FLASHATTN_SIMD_AVX2)
    // cvtps2dq rounds to nearest (even) in the default MXCSR mode, as the
    // magic-number add below does, in one instruction fewer (a NaN converts
    // to 0x80000000, which the shift makes 0).
    const vi ni = (vi)_mm256_cvtps_epi32((__m256)x);
    const vf n = (vf)_mm256_cvtepi32_ps((__m256i)ni);
    const vi e = ni << 23;
#else
    // Adding 1.5 * 2^23 rounds x to the nearest integer n, which lands in
    // the low mantissa bits of t; n is then added to p's exponent.
    const vf magic = splat(12582912.0f);
    const vf t = x + magic;
    const vf n = t - magic;
    const vi e = (float_to_bits(t) - float_to_bits(magic)) << 23;
#endif
    vf r = bits_to_float(float_to_bits(exp2_poly(x - n)) + e);
    // Below 2^-125 the exponent arithmetic would leave the normal range.
    r = bits_to_float(float_to_bits(r) & ~(x < splat(floor)));
#if !defined(FLASHATTN_SIMD_NEON) && !defined(FLASHATTN_SIMD_AVX2)
    // A NaN's payload bits reach e here, and e could make it a number.
    r = select(x == x, r, x);
#endif
    return r;
#endif
}

inline vf exp2(vf x, float floor = -125.0f) {
    // Above 127 the exponent arithmetic would overflow: the clamp keeps it
    // in range (and drops NaN), the select gives +inf from 128 on (and NaN
    // back).
    return select(x < splat(128.0f), exp2_upto127(min(x, splat(127.0f)), floor),
                  x + splat(kInf));
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA::simd
