// Small kernels that pin down metal-sim's <metal_stdlib> stand-ins for what
// the tiled kernels use (test_sim_shim): simdgroup_matrix layout, loads and
// stores with pitch, origin and transpose, multiply-accumulate (float, and
// the mixed half / bfloat / float products), filled matrices, function
// constants, NaN-aware simd_max / simd_min.
#include <metal_stdlib>

using namespace metal;

FA_FUNCTION_CONSTANT(int, test_int_constant, 10)
FA_FUNCTION_CONSTANT(bool, test_bool_constant, 11)
FA_FUNCTION_CONSTANT(float, test_float_constant, 12)

// out[lane * 2 + i] = element i of the lane's fragment of the 8x8 matrix
// src[r * 8 + c] (row-major): the layout, as thread_elements() shows it.
kernel void matrix_layout(device const float* src [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          uint3 group_pos [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
    (void)group_pos, (void)tid;
    simdgroup_float8x8 m;
    simdgroup_load(m, src);
    out[lane * 2 + 0] = m.thread_elements()[0];
    out[lane * 2 + 1] = m.thread_elements()[1];
}

// Loads an 8x8 block at origin (3, 2) of a 16-wide matrix, straight and
// transposed, and stores both at origin (1, 4) of 12-wide outputs.
kernel void matrix_load_store(device const float* src [[buffer(0)]],
                              device float* straight [[buffer(1)]],
                              device float* transposed [[buffer(2)]],
                              device float* stored_transposed [[buffer(3)]]) {
    simdgroup_float8x8 a, t;
    simdgroup_load(a, src, 16, ulong2(3, 2));
    simdgroup_load(t, src, 16, ulong2(3, 2), true);
    simdgroup_store(a, straight, 12, ulong2(1, 4));
    simdgroup_store(t, transposed, 12, ulong2(1, 4));
    simdgroup_store(a, stored_transposed, 12, ulong2(1, 4), true);
}

// d = a * b + c and e = a * b for 8x8 row-major a, b, c; f = 0.5 filled.
kernel void matrix_multiply(device const float* a [[buffer(0)]],
                            device const float* b [[buffer(1)]],
                            device const float* c [[buffer(2)]],
                            device float* d [[buffer(3)]],
                            device float* e [[buffer(4)]],
                            device float* f [[buffer(5)]]) {
    simdgroup_float8x8 ma, mb, mc, md, me;
    simdgroup_load(ma, a);
    simdgroup_load(mb, b);
    simdgroup_load(mc, c);
    simdgroup_multiply_accumulate(md, ma, mb, mc);
    simdgroup_multiply(me, ma, mb);
    simdgroup_store(md, d);
    simdgroup_store(me, e);
    simdgroup_store(make_filled_simdgroup_matrix<float, 8, 8>(0.5f), f);
}

// The mixed-type products of the 16-bit kernels (MSL lets a product's
// operand types differ from each other and from the result's, as
// llama.cpp's kernel_mul_mm multiplies half matrices into float ones):
// d16 = a b + c with a, b half, c and d16 float; dbf likewise with bfloat;
// dpv = p v with p float, v half (llama.cpp's P V); h = a b, a half result,
// rounded once. 8x8 row-major.
kernel void matrix_multiply_mixed(device const half* ah [[buffer(0)]],
                                  device const half* bh [[buffer(1)]],
                                  device const bfloat* abf [[buffer(2)]],
                                  device const bfloat* bbf [[buffer(3)]],
                                  device const float* c [[buffer(4)]],
                                  device float* d16 [[buffer(5)]],
                                  device float* dbf [[buffer(6)]],
                                  device float* dpv [[buffer(7)]],
                                  device half* h [[buffer(8)]]) {
    simdgroup_half8x8 a16, b16, h16;
    simdgroup_bfloat8x8 abfm, bbfm;
    simdgroup_float8x8 mc, md, mp;
    simdgroup_load(a16, ah);
    simdgroup_load(b16, bh);
    simdgroup_load(abfm, abf);
    simdgroup_load(bbfm, bbf);
    simdgroup_load(mc, c);
    simdgroup_multiply_accumulate(md, a16, b16, mc);
    simdgroup_store(md, d16);
    simdgroup_multiply_accumulate(md, abfm, bbfm, mc);
    simdgroup_store(md, dbf);
    simdgroup_multiply(mp, mc, b16);
    simdgroup_store(mp, dpv);
    simdgroup_multiply(h16, a16, b16);
    simdgroup_store(h16, h);
}

kernel void function_constants(device float* out [[buffer(0)]],
                               uint3 group_pos [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]]) {
    (void)group_pos;
    if (tid != 0) return;
    out[0] = float(int(test_int_constant));
    out[1] = bool(test_bool_constant) ? 1.0f : 0.0f;
    out[2] = float(test_float_constant);
}

// Lane 3 holds NaN, lane 5 -inf, lane 7 +inf... in `in`; out = simd_max,
// simd_min of the lanes.
kernel void nan_reductions(device const float* in [[buffer(0)]],
                           device float* out [[buffer(1)]],
                           uint3 group_pos [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]]) {
    (void)group_pos;
    const float mx = simd_max(in[tid]);
    const float mn = simd_min(in[tid]);
    if (tid == 0) {
        out[0] = mx;
        out[1] = mn;
    }
}
