// metal-sim's <metal_stdlib> stand-ins, against the Metal Shading Language
// spec (3.x, §6.7 SIMD-group matrix functions) and the lane layout MLX's
// steel mma.h relies on: which elements each lane holds, loads and stores
// (elements per row, origin, transpose), multiply-accumulate, filled
// matrices, function constants supplied per launch, NaN-aware
// simd_max / simd_min, and the half / bfloat conversions.
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "sim/launcher.h"

#include <metal_stdlib>

#include "sim_shim_kernels.metal"

#undef device
#undef constant
#undef threadgroup
#undef thread
#undef kernel

#include "sim/bind.h"

using namespace flashattn;
using namespace flashattn::sim;

namespace {

const Dim3 kOneGroup{1, 1, 1};
const Dim3 kOneSimdGroup{32, 1, 1};

Binding buf(std::vector<float>& v) { return {v.data(), false}; }

FunctionConstant constant_of(uint16_t index, FunctionConstant::Type type, uint32_t bits) {
    return {index, type, bits};
}

uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

}  // namespace

int main() {
    // The layout: lane L, q = L / 4, holds row (q & 4) + (L / 2) % 4 and
    // columns c, c + 1 with c = (q & 2) * 2 + (L % 2) * 2.
    {
        std::vector<float> src(64), out(64, -1.0f);
        for (int i = 0; i < 64; ++i) src[size_t(i)] = float(i);
        run_launch(make_kernel("matrix_layout", &matrix_layout), {buf(src), buf(out)}, kOneGroup,
                   kOneSimdGroup);
        int wrong = 0;
        std::vector<int> seen(64, 0);
        for (int lane = 0; lane < 32; ++lane) {
            const int q = lane / 4;
            const int row = (q & 4) + (lane / 2) % 4, col = (q & 2) * 2 + (lane % 2) * 2;
            wrong += out[size_t(lane * 2)] != float(row * 8 + col);
            wrong += out[size_t(lane * 2 + 1)] != float(row * 8 + col + 1);
            ++seen[size_t(out[size_t(lane * 2)])];
            ++seen[size_t(out[size_t(lane * 2 + 1)])];
        }
        CHECK(wrong == 0);
        int once = 0;  // every element is held by exactly one lane
        for (int n : seen) once += n == 1;
        CHECK(once == 64);
        // The lanes that share a row are L ^ 1, L ^ 8 and L ^ 9 (the kernels'
        // row reductions shuffle by 1 and by 8).
        for (int lane = 0; lane < 32; ++lane)
            for (int other : {lane ^ 1, lane ^ 8, lane ^ 9})
                CHECK(int(out[size_t(lane * 2)]) / 8 == int(out[size_t(other * 2)]) / 8);
    }
    // Loads and stores: element (r, c) is src[(origin.y + r) * epr + origin.x + c].
    {
        std::vector<float> src(16 * 12), straight(12 * 12, 0), transposed(12 * 12, 0),
            stored_t(12 * 12, 0);
        for (size_t i = 0; i < src.size(); ++i) src[i] = float(i);
        run_launch(make_kernel("matrix_load_store", &matrix_load_store),
                   {buf(src), buf(straight), buf(transposed), buf(stored_t)}, kOneGroup,
                   kOneSimdGroup);
        int wrong = 0, untouched = 0;
        for (int r = 0; r < 12; ++r)
            for (int c = 0; c < 12; ++c) {
                const bool inside = r >= 4 && r < 12 && c >= 1 && c < 9;
                const int mr = r - 4, mc = c - 1;  // position in the 8x8 matrix
                const float a = inside ? src[size_t((2 + mr) * 16 + 3 + mc)] : 0.0f;
                const float t = inside ? src[size_t((2 + mc) * 16 + 3 + mr)] : 0.0f;
                wrong += straight[size_t(r * 12 + c)] != a;
                wrong += transposed[size_t(r * 12 + c)] != t;
                wrong += stored_t[size_t(r * 12 + c)] != t;  // a stored transposed = t
                untouched += !inside && straight[size_t(r * 12 + c)] == 0.0f;
            }
        CHECK(wrong == 0);
        CHECK(untouched == 12 * 12 - 64);
    }
    // d = a * b + c, e = a * b, in float32 to within rounding of the exact sums.
    {
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        std::vector<float> a(64), b(64), c(64), d(64), e(64), f(64);
        for (int i = 0; i < 64; ++i) a[size_t(i)] = u(rng), b[size_t(i)] = u(rng), c[size_t(i)] = u(rng);
        run_launch(make_kernel("matrix_multiply", &matrix_multiply),
                   {buf(a), buf(b), buf(c), buf(d), buf(e), buf(f)}, kOneGroup, kOneSimdGroup);
        double worst = 0;
        int filled = 0;
        for (int r = 0; r < 8; ++r)
            for (int col = 0; col < 8; ++col) {
                double ab = 0;
                for (int k = 0; k < 8; ++k) ab += double(a[size_t(r * 8 + k)]) * b[size_t(k * 8 + col)];
                worst = std::max(worst, std::abs(d[size_t(r * 8 + col)] - (ab + c[size_t(r * 8 + col)])));
                worst = std::max(worst, std::abs(e[size_t(r * 8 + col)] - ab));
                filled += f[size_t(r * 8 + col)] == 0.5f;
            }
        std::printf("multiply-accumulate: worst error %.3g\n", worst);
        CHECK(worst < 1e-5);
        CHECK(filled == 64);
        // A SIMD group of fewer than 32 lanes cannot multiply: NaN, not a silent answer.
        std::fill(d.begin(), d.end(), 0.0f);
        run_launch(make_kernel("matrix_multiply", &matrix_multiply),
                   {buf(a), buf(b), buf(c), buf(d), buf(e), buf(f)}, kOneGroup, Dim3{16, 1, 1});
        // (lanes 0..15 store rows 0..3; every product needs rows of b that lanes 16..31 hold)
        int nan = 0;
        for (int i = 0; i < 32; ++i) nan += std::isnan(d[size_t(i)]);
        CHECK(nan == 32);
    }
    // Mixed types: 16-bit operands, float32 accumulation. A product of two
    // half (or two bfloat) values is exact in float32 (11 + 11 and 8 + 8
    // significant bits fit its 24): (1 + 2^-10)^2 = 1 + 2^-9 + 2^-20 must come
    // out whole, not rounded to the operand type; a half result is the
    // float32 sum rounded to half once.
    {
        using metal::half;
        using metal::bfloat;
        std::vector<half> ah(64, half(0.0f)), bh(64, half(0.0f)), h(64, half(-1.0f));
        std::vector<bfloat> abf(64, bfloat(0.0f)), bbf(64, bfloat(0.0f));
        std::vector<float> c(64, 0.0f), d16(64), dbf(64), dpv(64);
        for (int i = 0; i < 8; ++i) {  // a and b: one nonzero k (k = i) per row and column
            ah[size_t(i * 8 + i)] = half(1.0f + 0x1p-10f);
            bh[size_t(i * 8 + i)] = half(1.0f + 0x1p-10f);
            abf[size_t(i * 8 + i)] = bfloat(1.0f + 0x1p-7f);
            bbf[size_t(i * 8 + i)] = bfloat(1.0f + 0x1p-7f);
            c[size_t(i * 8 + i)] = i < 7 ? 1.0f / 3.0f : 0.0f;
        }
        c[1] = 0.25f;  // an off-diagonal c: d = c there
        auto ptr = [](auto& v) { return Binding{v.data(), false}; };
        run_launch(make_kernel("matrix_multiply_mixed", &matrix_multiply_mixed),
                   {ptr(ah), ptr(bh), ptr(abf), ptr(bbf), ptr(c), ptr(d16), ptr(dbf), ptr(dpv), ptr(h)},
                   kOneGroup, kOneSimdGroup);
        const float third = 1.0f / 3.0f;
        for (int i = 0; i < 7; ++i) {
            const size_t ii = size_t(i * 8 + i);
            CHECK(d16[ii] == std::fma(1.0f + 0x1p-10f, 1.0f + 0x1p-10f, third));
            CHECK(dbf[ii] == std::fma(1.0f + 0x1p-7f, 1.0f + 0x1p-7f, third));
            CHECK(dpv[ii] == third * (1.0f + 0x1p-10f));   // float times half, rounded once
            CHECK(float(h[ii]) == float(half(1.0f + 0x1p-9f + 0x1p-20f)));  // rounded once, to half
        }
        CHECK(d16[1] == 0.25f && dbf[1] == 0.25f && d16[2] == 0.0f);
        // c = 0: the product alone, whole (as a half it would be 1 + 2^-9).
        CHECK(d16[63] == 1.0f + 0x1p-9f + 0x1p-20f && dbf[63] == 1.0f + 0x1p-6f + 0x1p-14f);
        CHECK(float(h[63]) == 1.0f + 0x1p-9f);
    }
    // Function constants: the launch's values, by index; missing or mistyped ones are errors.
    {
        const Kernel k = make_kernel("function_constants", &function_constants);
        std::vector<float> out(3, -1.0f);
        run_launch(k, {buf(out)}, kOneGroup, kOneSimdGroup,
                   {constant_of(10, FunctionConstant::Type::int32, uint32_t(-7)),
                    constant_of(11, FunctionConstant::Type::boolean, 1),
                    constant_of(12, FunctionConstant::Type::float32, bits_of(2.75f))});
        CHECK(out[0] == -7.0f && out[1] == 1.0f && out[2] == 2.75f);
        run_launch(k, {buf(out)}, kOneGroup, kOneSimdGroup,
                   {constant_of(10, FunctionConstant::Type::int32, 3),
                    constant_of(11, FunctionConstant::Type::boolean, 0),
                    constant_of(12, FunctionConstant::Type::float32, bits_of(-0.5f))});
        CHECK(out[0] == 3.0f && out[1] == 0.0f && out[2] == -0.5f);
        CHECK_THROWS(std::runtime_error, "function constant 12 was not supplied",
                     run_launch(k, {buf(out)}, kOneGroup, kOneSimdGroup,
                                {constant_of(10, FunctionConstant::Type::int32, 3),
                                 constant_of(11, FunctionConstant::Type::boolean, 0)}));
        CHECK_THROWS(std::runtime_error, "another type",
                     run_launch(k, {buf(out)}, kOneGroup, kOneSimdGroup,
                                {constant_of(10, FunctionConstant::Type::float32, 0)}));
        CHECK_THROWS(std::runtime_error, "declared by no kernel",
                     run_launch(k, {buf(out)}, kOneGroup, kOneSimdGroup,
                                {constant_of(99, FunctionConstant::Type::int32, 0)}));
    }
    // simd_max / simd_min follow MSL's fmax / fmin: a NaN lane is ignored.
    {
        const Kernel k = make_kernel("nan_reductions", &nan_reductions);
        std::vector<float> in(32), out(2);
        for (int i = 0; i < 32; ++i) in[size_t(i)] = float(i % 7) - 3.0f;
        in[0] = std::numeric_limits<float>::quiet_NaN();
        in[3] = std::numeric_limits<float>::quiet_NaN();
        run_launch(k, {buf(in), buf(out)}, kOneGroup, kOneSimdGroup);
        CHECK(out[0] == 3.0f && out[1] == -3.0f);
        in.assign(32, std::numeric_limits<float>::quiet_NaN());
        run_launch(k, {buf(in), buf(out)}, kOneGroup, kOneSimdGroup);
        CHECK(std::isnan(out[0]) && std::isnan(out[1]));
        in.assign(32, -INFINITY);
        in[9] = std::numeric_limits<float>::quiet_NaN();
        run_launch(k, {buf(in), buf(out)}, kOneGroup, kOneSimdGroup);
        CHECK(out[0] == -INFINITY && out[1] == -INFINITY);
    }
    // half and bfloat: round to nearest even, NaN stays NaN, inf stays inf.
    {
        CHECK(float(metal::bfloat(1.0f)) == 1.0f);
        CHECK(float(metal::bfloat(1.0f + 1.0f / 256)) == 1.0f);               // tie: to even
        CHECK(float(metal::bfloat(1.0f + 3.0f / 256)) == 1.0f + 4.0f / 256);  // tie: to even (up)
        CHECK(float(metal::bfloat(1.0f + 1.5f / 256)) == 1.0f + 2.0f / 256);  // above half: up
        CHECK(std::isnan(float(metal::bfloat(std::numeric_limits<float>::quiet_NaN()))));
        CHECK(float(metal::bfloat(INFINITY)) == INFINITY);
        CHECK(float(metal::half(65504.0f)) == 65504.0f);
        CHECK(float(metal::half(1.0f + 1.0f / 2048)) == 1.0f);
        CHECK(std::isinf(float(metal::half(70000.0f))));
    }
    return flashattn_test::finish("test_sim_shim");
}
