// The cpu engine's element types at the edges of its tiles: rows of float32,
// float16 or bfloat16 inputs become float32 as they are loaded into a tile,
// in registers (F16C / AVX-512 vcvtph2ps for float16, a 16-bit shift for
// bfloat16, NEON's vcvt and vshll on arm64, the exact scalar conversions of
// core/half.h on the baseline), and results are rounded to the dtype once,
// to nearest even, as they are stored. Everything between is float32: the
// dtype is a template parameter of the one tile loop, not a copy of it.
// No float32 copy of a whole input is made: a tile's rows at a time.
#pragma once
#ifndef FLASHATTN_CPU_ISA
#error "include cpu/isa_begin.h first"
#endif

#include "core/half.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

// dst[0, n) = src[0, n) as float32, exactly.
inline void load_row(float* __restrict dst, const float* __restrict src, int n) {
    std::memcpy(dst, src, sizeof(float) * size_t(n));
}

inline void load_row(float* __restrict dst, const BFloat16* __restrict src, int n) {
    int i = 0;
#if defined(FLASHATTN_SIMD_AVX512)
    for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
#elif defined(FLASHATTN_SIMD_AVX2)
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
#elif defined(FLASHATTN_SIMD_NEON)
    for (; i + 4 <= n; i += 4) {
        const uint16x4_t h = vld1_u16(reinterpret_cast<const uint16_t*>(src + i));
        vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(h, 16)));
    }
#endif
    for (; i < n; ++i) dst[i] = to_float(src[i]);
}

inline void load_row(float* __restrict dst, const Half* __restrict src, int n) {
    int i = 0;
#if defined(FLASHATTN_SIMD_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(src + i))));
#elif defined(FLASHATTN_SIMD_AVX2)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i,
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#elif defined(FLASHATTN_SIMD_NEON)
    for (; i + 4 <= n; i += 4)
        vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(
                               vld1_u16(reinterpret_cast<const uint16_t*>(src + i)))));
#endif
    for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// dst[0, n) = src[0, n) * factor, rounded once to T (nearest even).
template <class T>
inline void store_row(T* __restrict dst, const float* __restrict src, int n, float factor = 1.0f) {
    for (int i = 0; i < n; ++i) dst[i] = from_float<T>(src[i] * factor);
}

// f(T{}) for the element type T of dtype (float, Half or BFloat16): the one
// place where a kernel's template is instantiated per dtype.
template <class F>
inline void with_element_type(DType dtype, F&& f) {
    switch (dtype) {
        case DType::f16: f(Half{}); return;
        case DType::bf16: f(BFloat16{}); return;
        case DType::f32: break;
    }
    f(float{});
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
