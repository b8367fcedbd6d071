// The gate proxy's simdgroup_matrix (part of its <metal_stdlib>), with MSL
// 3.x signatures (spec section 6.7, "SIMD-Group matrix load and stores"):
// each lane holds the two elements of Apple's layout (lane L, q = L / 4:
// row (q & 4) + (L / 2) % 4, columns (q & 2) * 2 + (L % 2) * 2 and the next,
// as MLX's steel mma.h get_coord spells it). Loads and stores move the
// lane's two elements. The multiply is an opaque instruction on the
// fragments' registers (an asm that reads a, b, c and writes d, 2 registers
// each): Apple's instruction is not known here, only what it keeps live.
#pragma once

namespace metal {

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
    static_assert(Cols == 8 && Rows == 8, "the gate models 8x8 simdgroup matrices only");
    vec<T, 2> elements;

    FA_GATE_DEVICE vec<T, 2>& thread_elements() { return elements; }
    FA_GATE_DEVICE const vec<T, 2>& thread_elements() const { return elements; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

}  // namespace metal

namespace fa_gate {

struct MatrixCoord {
    unsigned row, col;
};
FA_GATE_DEVICE MatrixCoord matrix_coord() {
    const unsigned lane = lane_id(), q = lane / 4;
    return MatrixCoord{(q & 4u) + (lane / 2) % 4, (q & 2u) * 2 + (lane % 2) * 2};
}

// A fragment as the 32-bit registers the asm sees: two for float elements;
// for half and bfloat the lane's pair packed in one register, as Apple's
// register file holds 16-bit pairs (r0 and r1 are then the same value, which
// the compiler keeps in one register).
struct Regs {
    unsigned r0, r1;
};
FA_GATE_DEVICE Regs regs(const metal::simdgroup_matrix<float, 8, 8>& m) {
    return Regs{__builtin_bit_cast(unsigned, m.elements[0]), __builtin_bit_cast(unsigned, m.elements[1])};
}
template <class T>
FA_GATE_DEVICE Regs regs(const metal::simdgroup_matrix<T, 8, 8>& m) {
    static_assert(sizeof(m.elements) == 4, "a 16-bit pair");
    const unsigned pair = __builtin_bit_cast(unsigned, m.elements);
    return Regs{pair, pair};
}
template <class T>
FA_GATE_DEVICE void set_regs(metal::simdgroup_matrix<T, 8, 8>& d, unsigned d0, unsigned d1) {
    if constexpr (sizeof(T) == 4) {
        d.elements = metal::vec<T, 2>(__builtin_bit_cast(T, d0), __builtin_bit_cast(T, d1));
    } else {
        (void)d1;
        d.elements = __builtin_bit_cast(metal::vec<T, 2>, d0);
    }
}

}  // namespace fa_gate

namespace metal {

template <class T, int C, int R>
FA_GATE_DEVICE simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
    simdgroup_matrix<T, C, R> m;
    m.elements = vec<T, 2>(value, value);
    return m;
}

// Element (r, c) of the matrix at src is src[(origin.y + r) * elements_per_row
// + origin.x + c]; with transpose_matrix the loaded matrix is its transpose.
// The pointer's element type is the matrix's, as in MSL (no conversion).
template <class T>
FA_GATE_DEVICE void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const T* src, ulong elements_per_row = 8,
                                   ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false) {
    const ::fa_gate::MatrixCoord at = ::fa_gate::matrix_coord();
    for (unsigned i = 0; i < 2; ++i) {
        const ulong r = transpose_matrix ? at.col + i : at.row;
        const ulong c = transpose_matrix ? at.row : at.col + i;
        d.elements[int(i)] = src[(matrix_origin.y + r) * elements_per_row + matrix_origin.x + c];
    }
}

template <class T>
FA_GATE_DEVICE void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, T* dst, ulong elements_per_row = 8,
                                    ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false) {
    const ::fa_gate::MatrixCoord at = ::fa_gate::matrix_coord();
    for (unsigned i = 0; i < 2; ++i) {
        const ulong r = transpose_matrix ? at.col + i : at.row;
        const ulong c = transpose_matrix ? at.row : at.col + i;
        dst[(matrix_origin.y + r) * elements_per_row + matrix_origin.x + c] = a.elements[int(i)];
    }
}

// d = a * b + c as one opaque instruction: reads 6 registers, writes 2.
template <class T, class TA, class TB, class TC>
FA_GATE_DEVICE void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                                  const simdgroup_matrix<TB, 8, 8>& b,
                                                  const simdgroup_matrix<TC, 8, 8>& c) {
    const ::fa_gate::Regs ra = ::fa_gate::regs(a), rb = ::fa_gate::regs(b), rc = ::fa_gate::regs(c);
    unsigned d0, d1;
#ifdef __AMDGPU__
    asm volatile("; simdgroup_multiply_accumulate %0 %1 <- %2 %3 * %4 %5 + %6 %7"
                 : "=v"(d0), "=v"(d1)
                 : "v"(ra.r0), "v"(ra.r1), "v"(rb.r0), "v"(rb.r1), "v"(rc.r0), "v"(rc.r1));
#else
    asm volatile("// simdgroup_multiply_accumulate %0 %1 <- %2 %3 * %4 %5 + %6 %7"
                 : "=r"(d0), "=r"(d1)
                 : "r"(ra.r0), "r"(ra.r1), "r"(rb.r0), "r"(rb.r1), "r"(rc.r0), "r"(rc.r1));
#endif
    ::fa_gate::set_regs(d, d0, d1);
}

template <class T, class TA, class TB>
FA_GATE_DEVICE void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                       const simdgroup_matrix<TB, 8, 8>& b) {
    simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, 8, 8>(T(0)));
}

}  // namespace metal
