// metal-sim's simdgroup_matrix<T, 8, 8> (MSL 3.x §6.7): each of the 32
// lanes holds exactly the two elements Apple's layout gives it, so kernels
// that read or shuffle thread_elements() run as on the GPU. Lane L holds
// row (q & 4) + ((L / 2) % 4), columns c and c + 1 with c = (q & 2) * 2 +
// (L % 2) * 2, where q = L / 4 (the mapping MLX's steel mma.h get_coord
// relies on). Loads and stores touch only the lane's own elements; a
// multiply-accumulate is a SIMD-group rendezvous (every lane offers its
// elements of a, b and c, then computes its own two results), so it must be
// reached by all 32 lanes together, as on the GPU.
#pragma once

#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "metal_types.h"
#include "sim/runtime.h"

namespace metal {

struct ulong2 {
    unsigned long x = 0, y = 0;
    ulong2() = default;
    constexpr ulong2(unsigned long x_, unsigned long y_) : x(x_), y(y_) {}
    constexpr ulong2(int zero)  // ulong2(0), as MSL code writes the default origin
        : x(static_cast<unsigned long>(zero)), y(static_cast<unsigned long>(zero)) {}
};

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
    static_assert(Cols == 8 && Rows == 8, "metal-sim models 8x8 SIMD-group matrices only");
    vec<T, 2> elements;

    vec<T, 2>& thread_elements() { return elements; }
    const vec<T, 2>& thread_elements() const { return elements; }
};

using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;

namespace simdgroup_detail {

struct Coord {
    unsigned row, col;  // the lane's first element; the second is (row, col + 1)
};
inline Coord coord(unsigned lane) {
    const unsigned q = lane / 4;
    const unsigned col = (q & 2) * 2 + (lane % 2) * 2;
    // The planted fault of the self-test's tests: column pairs swapped.
    return {(q & 4) + (lane / 2) % 4, ::fa_sim::lane_map_fault() ? col ^ 2u : col};
}

}  // namespace simdgroup_detail

template <class T, int C, int R>
simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
    simdgroup_matrix<T, C, R> m;
    m.elements = vec<T, 2>(value, value);
    return m;
}

// Element (r, c) of the matrix at src is src[(origin.y + r) * elements_per_row
// + origin.x + c]; with transpose_matrix the loaded matrix is its transpose.
template <class T, class P>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, P src, unsigned long elements_per_row = 8,
                    ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false) {
#ifndef FA_SIM_STRICT_ADDRESS_SPACES
    // As in MSL, the matrix's element type is the memory's: no conversion.
    static_assert(std::is_same<typename std::remove_cv<typename std::remove_pointer<P>::type>::type, T>::value,
                  "simdgroup_load: the pointer's element type must be the matrix's");
#endif
    ::fa_sim::count_op(::fa_sim::Op::matrix_load);
    const auto at = simdgroup_detail::coord(::fa_sim::simd_lane());
    for (unsigned i = 0; i < 2; ++i) {
        const unsigned long r = transpose_matrix ? at.col + i : at.row;
        const unsigned long c = transpose_matrix ? at.row : at.col + i;
        d.elements[int(i)] = T(src[(matrix_origin.y + r) * elements_per_row + matrix_origin.x + c]);
    }
}

template <class T, class P>
void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, P dst, unsigned long elements_per_row = 8,
                     ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false) {
    ::fa_sim::count_op(::fa_sim::Op::matrix_store);
    const auto at = simdgroup_detail::coord(::fa_sim::simd_lane());
    for (unsigned i = 0; i < 2; ++i) {
        const unsigned long r = transpose_matrix ? at.col + i : at.row;
        const unsigned long c = transpose_matrix ? at.row : at.col + i;
        dst[(matrix_origin.y + r) * elements_per_row + matrix_origin.x + c] = a.elements[int(i)];
    }
}

namespace simdgroup_detail {

// What a lane brings to a multiply-accumulate, and what it takes away.
struct MmaOffer {
    float a[2], b[2], c[2];
};
struct MmaResult {
    float d[2];
};

// The product, once per SIMD group: the lanes' elements placed by the
// layout, d = a * b + c in float32 with fma in k order (a fixed order, so
// the simulator is bit-for-bit repeatable).
inline void mma_combine(const void* offers_, unsigned lanes, void* results_) {
    const MmaOffer* offers = static_cast<const MmaOffer*>(offers_);
    MmaResult* results = static_cast<MmaResult*>(results_);
    // A SIMD group of fewer than 32 lanes leaves elements unset: NaN, so a
    // kernel that multiplies in one cannot pass a test.
    float A[8][8], B[8][8], C[8][8];
    for (unsigned r = 0; r < 8; ++r)
        for (unsigned c = 0; c < 8; ++c) A[r][c] = B[r][c] = C[r][c] = std::nanf("");
    for (unsigned l = 0; l < lanes; ++l) {
        const Coord at = coord(l);
        for (unsigned i = 0; i < 2; ++i) {
            A[at.row][at.col + i] = offers[l].a[i];
            B[at.row][at.col + i] = offers[l].b[i];
            C[at.row][at.col + i] = offers[l].c[i];
        }
    }
    for (unsigned l = 0; l < lanes; ++l) {
        const Coord at = coord(l);
        for (unsigned i = 0; i < 2; ++i) {
            float acc = C[at.row][at.col + i];
            for (unsigned k = 0; k < 8; ++k) acc = std::fma(A[at.row][k], B[k][at.col + i], acc);
            results[l].d[i] = acc;
        }
    }
}

}  // namespace simdgroup_detail

// d = a * b + c, computed in float32 and rounded to T once. A SIMD-group
// operation: all 32 lanes must reach it together.
template <class T, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b,
                                   const simdgroup_matrix<TC, 8, 8>& c) {
    const simdgroup_detail::MmaOffer mine{{float(a.elements.x), float(a.elements.y)},
                                          {float(b.elements.x), float(b.elements.y)},
                                          {float(c.elements.x), float(c.elements.y)}};
    simdgroup_detail::MmaResult result;
    ::fa_sim::count_op(::fa_sim::Op::mma);
    ::fa_sim::simd_collective(&mine, sizeof mine, &simdgroup_detail::mma_combine, &result,
                              sizeof result);
    d.elements[0] = T(result.d[0]);
    d.elements[1] = T(result.d[1]);
}

template <class T, class TA, class TB>
void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                        const simdgroup_matrix<TB, 8, 8>& b) {
    simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, 8, 8>(T(0)));
}

}  // namespace metal
