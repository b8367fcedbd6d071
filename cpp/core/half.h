// The two 16-bit float formats as storage types, with exact scalar
// conversions: to float32 exactly (every half and bfloat16 value is a
// float32), and from float32 rounded to nearest, ties to even, as IEEE 754
// and NumPy / ml_dtypes round (NaN stays NaN, overflow becomes inf).
// Shared by the core (sinks' gradient), the cpu engine's scalar paths and
// the C++ tests; the cpu engine's vector conversions (cpu/convert.h) agree
// with these bit for bit.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace flashattn {

struct Half {  // IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits
    uint16_t bits;
};
struct BFloat16 {  // the top 16 bits of a float32: 1 sign, 8 exponent, 7 mantissa bits
    uint16_t bits;
};

inline uint32_t float_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
inline float bits_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return bits_float(uint32_t(x.bits) << 16); }
inline float to_float(Half x) {
    const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
    const uint32_t exp = (x.bits >> 10) & 0x1fu, mant = x.bits & 0x3ffu;
    if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
        const float v = float(mant) * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

template <class T>
T from_float(float x);

template <>
inline float from_float<float>(float x) {
    return x;
}
template <>
inline BFloat16 from_float<BFloat16>(float x) {
    uint32_t u = float_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40u)};  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return {uint16_t(u >> 16)};
}
template <>
inline Half from_float<Half>(float x) {
    uint32_t u = float_bits(x);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return {uint16_t(sign | 0x7e00u | ((u >> 13) & 0x3ffu))};  // NaN
    if (u >= 0x477ff000u) return {uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to inf
    if (u < 0x38800000u) {  // below 2^-14: a subnormal half, mant = round(|x| * 2^24)
        const float scaled = bits_float(u) * 16777216.0f;  // exact: a power of two
        return {uint16_t(sign | uint16_t(std::nearbyint(scaled)))};
    }
    u += 0xc8000fffu + ((u >> 13) & 1u);  // rebias the exponent by -112, round half to even
    return {uint16_t(sign | (u >> 13))};
}

}  // namespace flashattn
