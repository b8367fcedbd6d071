// metal-sim's stand-ins for MSL's scalar and vector types that C++ lacks:
// half (IEEE binary16), bfloat (bfloat16, MSL 3.1), and vec<T, N> with the
// float2 / float4 / half2 / ... names and the packed_ variants. Included by
// the <metal_stdlib> shim; only what the kernels use is here.
#pragma once

#include <cstdint>
#include <cstring>

namespace metal {

// binary16, with the compiler's own conversions (round to nearest even).
// GCC before 13 has no C++ _Float16 on arm64; its __fp16 is the same
// format there, converted the same way (arithmetic happens in float).
#if defined(__aarch64__) && !defined(__clang__) && defined(__GNUC__) && __GNUC__ < 13
using half = __fp16;
#else
using half = _Float16;
#endif

#ifdef FA_SIM_STRICT_ADDRESS_SPACES
// The syntax-only strict mode: clang's own bfloat16 type (clang 17+), which
// converts from an object in any address space as MSL's bfloat does (a
// struct's conversion operator would want its object in the generic one).
using bfloat = __bf16;
#else
// bfloat16: the upper half of a float32. Conversions round to nearest even
// and keep NaN a NaN, as Apple's hardware conversion does.
struct bfloat {
    uint16_t bits = 0;

    bfloat() = default;
    bfloat(float f) : bits(from_float(f)) {}  // NOLINT: implicit, as in MSL
    operator float() const {
        const uint32_t u = uint32_t(bits) << 16;
        float f;
        std::memcpy(&f, &u, sizeof f);
        return f;
    }

    static uint16_t from_float(float f) {
        uint32_t u;
        std::memcpy(&u, &f, sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
        const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
        return uint16_t((u + rounding) >> 16);
    }
};
#endif

// vec<T, N>: element access by .x .y .z .w and by [i]; componentwise
// arithmetic. 4-byte alignment for float vectors, so they also serve as the
// packed_ types (MSL's aligned float4 is only stricter).
template <class T, int N>
struct vec;

template <class T>
struct vec<T, 2> {
    T x, y;
    vec() : x(), y() {}
    vec(T a, T b) : x(a), y(b) {}
    explicit vec(T a) : x(a), y(a) {}
    T& operator[](int i) { return i == 0 ? x : y; }
    const T& operator[](int i) const { return i == 0 ? x : y; }
};

template <class T>
struct vec<T, 4> {
    T x, y, z, w;
    vec() : x(), y(), z(), w() {}
    vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
    explicit vec(T a) : x(a), y(a), z(a), w(a) {}
    T& operator[](int i) { return i == 0 ? x : i == 1 ? y : i == 2 ? z : w; }
    const T& operator[](int i) const { return i == 0 ? x : i == 1 ? y : i == 2 ? z : w; }
};

template <class T, int N>
vec<T, N> operator*(vec<T, N> a, vec<T, N> b) {
    for (int i = 0; i < N; ++i) a[i] = a[i] * b[i];
    return a;
}
template <class T, int N>
vec<T, N> operator*(vec<T, N> a, T s) {
    for (int i = 0; i < N; ++i) a[i] = a[i] * s;
    return a;
}
template <class T, int N>
vec<T, N> operator+(vec<T, N> a, vec<T, N> b) {
    for (int i = 0; i < N; ++i) a[i] = a[i] + b[i];
    return a;
}
template <class T, int N>
vec<T, N> operator-(vec<T, N> a, vec<T, N> b) {
    for (int i = 0; i < N; ++i) a[i] = a[i] - b[i];
    return a;
}

using float2 = vec<float, 2>;
using float4 = vec<float, 4>;
using half2 = vec<half, 2>;
using half4 = vec<half, 4>;
using bfloat2 = vec<bfloat, 2>;
using bfloat4 = vec<bfloat, 4>;
using packed_float2 = vec<float, 2>;
using packed_float4 = vec<float, 4>;
using packed_half4 = vec<half, 4>;

}  // namespace metal
