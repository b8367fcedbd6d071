// The gate proxy's scalar and vector types and math (part of its
// <metal_stdlib>): MSL's half, bfloat and vec<T, N>, and the functions the
// kernels call, each mapped to an LLVM intrinsic both GPU back ends lower
// inline, so that no kernel makes a call whose resources the gate cannot see.
#pragma once

namespace metal {

typedef _Float16 half;

// MSL bfloat: the top 16 bits of a float; arithmetic in float, rounded to
// nearest even on conversion.
struct bfloat {
    unsigned short bits;
    bfloat() = default;
    FA_GATE_DEVICE bfloat(float x) {
        unsigned u = __builtin_bit_cast(unsigned, x);
        u += 0x7fffu + ((u >> 16) & 1u);
        bits = (unsigned short)(u >> 16);
    }
    FA_GATE_DEVICE operator float() const { return __builtin_bit_cast(float, unsigned(bits) << 16); }
};

template <class T, int N>
struct vec;

// Component access by name (.x .y .z .w) and by index, over one array.
#define FA_GATE_VEC_COMMON(N)                                                          \
    vec() = default;                                                                   \
    FA_GATE_DEVICE vec(T s) { /* MSL: a scalar converts to a vector implicitly */      \
        for (int i = 0; i < N; ++i) e[i] = s;                                          \
    }                                                                                  \
    template <class U>                                                                 \
    FA_GATE_DEVICE explicit vec(const vec<U, N>& o) {                                  \
        for (int i = 0; i < N; ++i) e[i] = T(o[i]);                                    \
    }                                                                                  \
    FA_GATE_DEVICE T& operator[](int i) { return e[i]; }                               \
    FA_GATE_DEVICE const T& operator[](int i) const { return e[i]; }

template <class T>
struct vec<T, 2> {
    union {
        T e[2];
        struct {
            T x, y;
        };
    };
    FA_GATE_VEC_COMMON(2)
    FA_GATE_DEVICE vec(T a, T b) : x(a), y(b) {}
};
template <class T>
struct vec<T, 3> {
    union {
        T e[3];
        struct {
            T x, y, z;
        };
    };
    FA_GATE_VEC_COMMON(3)
    FA_GATE_DEVICE vec(T a, T b, T c) : x(a), y(b), z(c) {}
};
template <class T>
struct vec<T, 4> {
    union {
        T e[4];
        struct {
            T x, y, z, w;
        };
    };
    FA_GATE_VEC_COMMON(4)
    FA_GATE_DEVICE vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
    FA_GATE_DEVICE vec(vec<T, 2> a, vec<T, 2> b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
};
#undef FA_GATE_VEC_COMMON

// Element-wise arithmetic, vector with vector or with a scalar.
#define FA_GATE_VEC_OP(op)                                                             \
    template <class T, int N>                                                          \
    FA_GATE_DEVICE vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {            \
        for (int i = 0; i < N; ++i) a[i] = a[i] op b[i];                               \
        return a;                                                                      \
    }                                                                                  \
    template <class T, int N>                                                          \
    FA_GATE_DEVICE vec<T, N> operator op(vec<T, N> a, T s) {                           \
        for (int i = 0; i < N; ++i) a[i] = a[i] op s;                                  \
        return a;                                                                      \
    }                                                                                  \
    template <class T, int N>                                                          \
    FA_GATE_DEVICE vec<T, N> operator op(T s, vec<T, N> a) {                           \
        for (int i = 0; i < N; ++i) a[i] = s op a[i];                                  \
        return a;                                                                      \
    }                                                                                  \
    template <class T, int N>                                                          \
    FA_GATE_DEVICE vec<T, N>& operator op##=(vec<T, N>& a, const vec<T, N>& b) {       \
        return a = a op b;                                                             \
    }                                                                                  \
    template <class T, int N>                                                          \
    FA_GATE_DEVICE vec<T, N>& operator op##=(vec<T, N>& a, T s) {                      \
        return a = a op s;                                                             \
    }
FA_GATE_VEC_OP(+)
FA_GATE_VEC_OP(-)
FA_GATE_VEC_OP(*)
FA_GATE_VEC_OP(/)
#undef FA_GATE_VEC_OP

template <class T, int N>
FA_GATE_DEVICE vec<T, N> operator-(vec<T, N> a) {
    for (int i = 0; i < N; ++i) a[i] = -a[i];
    return a;
}

typedef vec<float, 2> float2;
typedef vec<float, 3> float3;
typedef vec<float, 4> float4;
typedef vec<half, 2> half2;
typedef vec<half, 4> half4;
typedef vec<bfloat, 2> bfloat2;
typedef vec<bfloat, 4> bfloat4;
typedef vec<int, 2> int2;
typedef vec<int, 4> int4;
typedef vec<uint, 2> uint2;
typedef vec<uint, 3> uint3;
typedef vec<uint, 4> uint4;
typedef vec<ushort, 2> ushort2;
typedef vec<ulong, 2> ulong2;
// Packed vectors differ from the others only in alignment, which the gate
// does not model.
typedef float2 packed_float2;
typedef float4 packed_float4;
typedef half4 packed_half4;

// Math: float in, float out; half and bfloat through float.
FA_GATE_DEVICE float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
// exp2 and log2 are the hardware's (nvptx has no full-precision lowering
// of them without libdevice; Apple's GPUs also compute them in hardware).
#ifdef __AMDGPU__
FA_GATE_DEVICE float exp2(float x) { return __builtin_exp2f(x); }
FA_GATE_DEVICE float log2(float x) { return __builtin_log2f(x); }
#else
FA_GATE_DEVICE float exp2(float x) { return __nvvm_ex2_approx_f(x); }
FA_GATE_DEVICE float log2(float x) { return __nvvm_lg2_approx_f(x); }
#endif
FA_GATE_DEVICE float exp(float x) { return exp2(x * M_LOG2E_F); }
FA_GATE_DEVICE float log(float x) { return log2(x) * M_LN2_F; }
FA_GATE_DEVICE float sqrt(float x) { return __builtin_sqrtf(x); }
FA_GATE_DEVICE float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
FA_GATE_DEVICE float abs(float x) { return __builtin_fabsf(x); }
FA_GATE_DEVICE float fabs(float x) { return __builtin_fabsf(x); }
FA_GATE_DEVICE int abs(int x) { return x < 0 ? -x : x; }
// MSL's float max / min are fmax / fmin: a NaN operand yields the other.
FA_GATE_DEVICE float max(float a, float b) { return __builtin_fmaxf(a, b); }
FA_GATE_DEVICE float min(float a, float b) { return __builtin_fminf(a, b); }
FA_GATE_DEVICE float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
FA_GATE_DEVICE float fmin(float a, float b) { return __builtin_fminf(a, b); }
FA_GATE_DEVICE half max(half a, half b) { return half(__builtin_fmaxf(float(a), float(b))); }
FA_GATE_DEVICE half min(half a, half b) { return half(__builtin_fminf(float(a), float(b))); }
template <class T>
FA_GATE_DEVICE T max(T a, T b) {
    return a < b ? b : a;
}
template <class T>
FA_GATE_DEVICE T min(T a, T b) {
    return b < a ? b : a;
}
template <class T>
FA_GATE_DEVICE T clamp(T x, T lo, T hi) {
    return min(max(x, lo), hi);
}
FA_GATE_DEVICE bool isnan(float x) { return __builtin_isnan(x); }
FA_GATE_DEVICE bool isinf(float x) { return __builtin_isinf(x); }
FA_GATE_DEVICE bool isfinite(float x) { return __builtin_isfinite(x); }
// select(a, b, c) = c ? b : a.
template <class T>
FA_GATE_DEVICE T select(T a, T b, bool c) {
    return c ? b : a;
}

// Memory-order flags of the barriers.
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
FA_GATE_DEVICE mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }

}  // namespace metal

using metal::uint2;
using metal::uint3;
using metal::ulong2;
