// Planted kernels that show the gate can tell registers from scratch: each
// has a known verdict (tests/gpu_gate/CMakeLists.txt gives gate.py the list
// and the expectations), and the gpu_gate_planted test passes only if the
// gate judges every one as expected.
//   planted_tiles:    8x8 simdgroup_matrix tiles in registers, a function
//                     constant, shuffles, threadgroup staging -> passes;
//   planted_types:    half and bfloat fragments, vectors, conversions and
//                     every SIMD-group function the proxy models -> passes;
//   planted_scratch:  a per-thread array indexed by a run-time bound (what
//                     the one-thread-per-row kernels do) -> scratch;
//   planted_vgprs:    160 floats live per thread, every index a constant:
//                     more than the 128 registers the proxy compiler is
//                     given (Apple's limit) -> spilled to scratch.
#include <metal_stdlib>

using namespace metal;

struct PlantedParams {
    int n;
    float scale;
};

FA_FUNCTION_CONSTANT(bool, planted_full, 0)

kernel void planted_tiles(device const float* a [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          constant PlantedParams& p [[buffer(2)]],
                          uint3 group [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]]) {
    FA_TG_ARRAY(float, tile, 64 * 4);
    for (int e = int(tid); e < 64 * 4; e += 128) tile[e] = a[group.x * 256 + e];
    threadgroup_barrier(mem_flags::mem_threadgroup);

    simdgroup_float8x8 acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int k = 0; k < p.n; ++k) {
        simdgroup_float8x8 x, y;
        simdgroup_load(x, tile + sg * 64, 8);
        simdgroup_load(y, tile + ((sg + 1) % 4) * 64, 8, ulong2(0, 0), true);
        for (int i = 0; i < 4; ++i) simdgroup_multiply_accumulate(acc[i], x, y, acc[i]);
    }
    float s = 0.0f;
    for (int i = 0; i < 4; ++i) s += acc[i].thread_elements()[0] + acc[i].thread_elements()[1];
    s = planted_full ? s : simd_sum(s) * p.scale;
    s = max(s, simd_shuffle_xor(s, ushort(1)));
    out[group.x * 128 + tid] = exp2(s) + float(lane);
}

kernel void planted_types(device const half* a [[buffer(0)]],
                          device const bfloat* b [[buffer(1)]],
                          device float* out [[buffer(2)]],
                          constant PlantedParams& p [[buffer(3)]],
                          uint3 group [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
    FA_TG_ARRAY(half, ha, 64);
    FA_TG_ARRAY(bfloat, hb, 64);
    if (tid < 64) {
        ha[tid] = a[group.x * 64 + tid];
        hb[tid] = b[group.x * 64 + tid];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_half8x8 x;
    simdgroup_bfloat8x8 y;
    simdgroup_load(x, ha, 8);
    simdgroup_load(y, hb, 8, ulong2(0, 0), true);
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_multiply_accumulate(acc, x, y, acc);
    simdgroup_multiply(acc, x, x);
    simdgroup_half8x8 h;
    simdgroup_multiply(h, x, x);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_store(h, ha, 8);

    const float2 e = acc.thread_elements();
    const half2 hv = half2(h.thread_elements());
    float4 v = float4(e, float2(float(hv.x), float(hv.y)));
    v = v * p.scale + float4(1.0f);
    uint2 u = uint2(lane, tid);
    ushort sh = ushort(u.x + u.y);
    float s = v.x + v[1] + v.z + v.w + float(sh);
    s = simd_sum(s) + simd_max(s) + simd_min(s);
    s += simd_shuffle(s, ushort(3)) + simd_broadcast(s, ushort(0)) + simd_shuffle_down(s, ushort(1)) +
         simd_shuffle_up(s, ushort(2));
    s = select(s, -s, isnan(s) || isinf(s) || s > FLT_MAX);
    s = abs(fma(exp(s), log(abs(s) + 1.0f), min(s, INFINITY)));
    simdgroup_barrier(mem_flags::mem_none);
    out[group.x * 64 + tid] = s + float(half(s)) + float(bfloat(s));
}

kernel void planted_scratch(device const float* a [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            constant PlantedParams& p [[buffer(2)]],
                            uint3 group [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]]) {
    float row[64];
    const int i = int(group.x * 64 + tid);
    for (int d = 0; d < p.n; ++d) row[d] = a[i * 64 + d];
    float s = 0.0f;
    for (int d = p.n - 1; d >= 0; --d) s = fma(row[d], row[(d * 7) % p.n], s);
    out[i] = s;
}

kernel void planted_vgprs(device const float* a [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          constant PlantedParams& p [[buffer(2)]],
                          uint3 group [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]]) {
    float row[160];
    const int i = int(group.x * 64 + tid);
    #pragma clang loop unroll(full)
    for (int d = 0; d < 160; ++d) row[d] = a[i * 160 + d];
    for (int k = 0; k < p.n; ++k) {
        const float x = a[k];
        #pragma clang loop unroll(full)
        for (int d = 0; d < 160; ++d) row[d] = fma(row[d], x, row[(d + 1) % 160]);
    }
    #pragma clang loop unroll(full)
    for (int d = 0; d < 160; ++d) out[i * 160 + d] = row[d];
}
