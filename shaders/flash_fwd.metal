// Fused attention forward: o = softmax(scale * q k^T, masked) v and the
// per-row log-sum-exp, without ever writing a T^2 matrix.
//
// Work split (the seed's): one GPU thread per query row, FA_ROWS_PER_GROUP
// consecutive rows of one (batch, head) per threadgroup. K and V reach the
// group through threadgroup memory, FA_TILE(HD) key rows at a time, staged by
// all threads together, so each K/V element is read from device memory once
// per threadgroup instead of once per row. Only the keys some row of the
// group can see are visited: blocks outside the causal/window band are never
// loaded, so cost follows the window, not Tk.
//
// Online softmax (FlashAttention-2): m = running max, l = running sum,
// acc = running unnormalised output; divided by l once at the end. m starts
// at -FLT_MAX, never -INFINITY, because exp(-inf - (-inf)) is NaN. A row that
// sees no key gets o = 0, lse = -inf.
//
// Threadgroup memory: Ks + Vs = 2 * FA_TILE(HD) * HD floats
// (hd32 8 KiB, hd64 16 KiB, hd96 12 KiB, hd128 16 KiB, hd256 16 KiB).
#include <metal_stdlib>

#include "flash_device.h"

using namespace metal;

template <int HD>
kernel void flash_fwd(device const float* q [[buffer(0)]],
                      device const float* k [[buffer(1)]],
                      device const float* v [[buffer(2)]],
                      device float* o [[buffer(3)]],
                      device float* lse [[buffer(4)]],
                      constant FlashParams& p [[buffer(5)]],
                      uint3 grid_pos [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]]) {
    const uint3 group_pos = fa_group_position(grid_pos, p);
    const int TILE = FA_TILE(HD);
    FA_TG_ARRAY(float, Ks, FA_TILE(HD) * HD);
    FA_TG_ARRAY(float, Vs, FA_TILE(HD) * HD);

    const int D = p.D;
    const int h = int(group_pos.y);
    const int b = int(group_pos.z);
    const int hkv = h / p.group;
    const int row0 = int(group_pos.x) * FA_ROWS_PER_GROUP;
    const int i = row0 + int(tid);
    const bool active = i < p.Tq;
    const int last_row = min(row0 + FA_ROWS_PER_GROUP, p.Tq) - 1;

    // Keys seen by any row of the group (begin and end grow with the row),
    // uniform across the group so every thread meets the same barriers.
    const fa_long group_begin = fa_key_begin(row0, p.Tq, p.Tk, p.window_left);
    const fa_long group_end = fa_key_end(last_row, p.Tq, p.Tk, p.window_right);
    // This row's own keys.
    const fa_long row_begin = active ? fa_key_begin(i, p.Tq, p.Tk, p.window_left) : 0;
    const fa_long row_end = active ? fa_key_end(i, p.Tq, p.Tk, p.window_right) : 0;

    float qr[HD];
    float acc[HD];
    const fa_long qo = fa_offset(p.q.b, p.q.t, p.q.h, b, i, h);
    for (int d = 0; d < D; ++d) {
        qr[d] = active ? q[qo + d] : 0.0f;
        acc[d] = 0.0f;
    }
    float m = -FLT_MAX;
    float l = 0.0f;

    for (fa_long j0 = group_begin; j0 < group_end; j0 += TILE) {
        const int n = int(group_end - j0 < TILE ? group_end - j0 : TILE);

        // Nobody may still be reading the previous tile.
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int e = int(tid); e < n * D; e += FA_ROWS_PER_GROUP) {
            const int r = e / D;
            const int d = e - r * D;
            Ks[r * HD + d] = k[fa_offset(p.k.b, p.k.t, p.k.h, b, j0 + r, hkv) + d];
            Vs[r * HD + d] = v[fa_offset(p.v.b, p.v.t, p.v.h, b, j0 + r, hkv) + d];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        if (!active) continue;
        for (int r = 0; r < n; ++r) {
            const fa_long j = j0 + r;
            if (j < row_begin || j >= row_end) continue;
            threadgroup const float* kj = Ks + r * HD;
            float s = 0.0f;
            for (int d = 0; d < D; ++d) s = fma(qr[d], kj[d], s);
            s *= p.scale;

            const float m_new = max(m, s);
            const float corr = exp(m - m_new);  // 0 on the first visible key
            const float e = exp(s - m_new);
            l = l * corr + e;
            threadgroup const float* vj = Vs + r * HD;
            for (int d = 0; d < D; ++d) acc[d] = fma(acc[d], corr, e * vj[d]);
            m = m_new;
        }
    }

    if (!active) return;
    // Decided by the mask, not by l: a NaN or inf in the input must reach
    // o and lse of the rows it touches (l is then NaN), as IEEE says.
    const bool sees_keys = row_begin < row_end;
    const float inv = sees_keys ? 1.0f / l : 0.0f;
    const fa_long oo = fa_offset(p.o.b, p.o.t, p.o.h, b, i, h);
    for (int d = 0; d < D; ++d) o[oo + d] = acc[d] * inv;
    lse[(fa_long(b) * p.H + h) * p.Tq + i] = sees_keys ? m + log(l) : -INFINITY;
}

#define FA_INSTANTIATE_FWD(HD)                                                              \
    template FA_HOST_NAME("flash_fwd_f32_hd" #HD) kernel void flash_fwd<HD>(               \
        device const float*, device const float*, device const float*, device float*,       \
        device float*, constant FlashParams&, uint3, uint);

FA_HEAD_BUCKETS(FA_INSTANTIATE_FWD)
