// The metal engine's lane-layout probe (issue 34's self-test, core/selftest.h):
// one SIMD group checks on the GPU in hand the layout every tiled kernel
// assumes for an 8x8 simdgroup_matrix -- lane L holds row fa_lane(L).row,
// columns fa_lane(L).col and col + 1 (shaders/flash_device.h) -- which no
// Apple document states and nothing here can run. It writes, for the host
// to compare with what that layout gives (check_lane_probe):
//   [0, 64)     each lane's two elements of A = in (row-major), loaded by simdgroup_load;
//   [64, 128)   the same of A's transposed load;
//   [128, 192)  C = A B stored by simdgroup_store, B written lane by lane
//               through thread_elements() at the assumed places (a
//               permutation: B[r][c] = 1 where c = (r + 3) % 8);
//   [192, 224)  each lane's sum over its row by the kernels' shuffles
//               (fa_row_sum: lanes ^1 and ^8 share a row).
#include <metal_stdlib>

#include "flash_device.h"

kernel void flash_selftest_lanes(device const float* in [[buffer(0)]],
                                 device float* out [[buffer(1)]],
                                 uint3 grid_pos [[threadgroup_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]]) {
    (void)grid_pos;
    (void)tid;
    fa_frag a, at, b, c;
    simdgroup_load(a, in, 8ul, ulong2(0, 0), false);
    simdgroup_load(at, in, 8ul, ulong2(0, 0), true);
    out[lane * 2] = a.thread_elements()[0];
    out[lane * 2 + 1] = a.thread_elements()[1];
    out[64 + lane * 2] = at.thread_elements()[0];
    out[64 + lane * 2 + 1] = at.thread_elements()[1];

    const FaLane place = fa_lane(lane);
    b.thread_elements()[0] = place.col == (place.row + 3) % 8 ? 1.0f : 0.0f;
    b.thread_elements()[1] = place.col + 1 == (place.row + 3) % 8 ? 1.0f : 0.0f;
    c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_multiply_accumulate(c, a, b, c);
    simdgroup_store(c, out + 128, 8ul, ulong2(0, 0), false);

    out[192 + lane] = fa_row_sum(a.thread_elements()[0] + a.thread_elements()[1]);
}
