// Fused attention backward (FlashAttention-2 split), three kernels run in
// this order by plan_backward:
//   flash_bwd_preprocess_f32     delta = rowsum(dout * o), one float per row
//   flash_bwd_dq_f32_hd{HD}      dq, one thread per query row
//   flash_bwd_dkdv_f32_hd{HD}    dk and dv, one thread per key row
// Probabilities are recomputed from q, k and the forward's lse, tile by
// tile, never stored. Every gradient row is owned by exactly one thread that
// sums in a fixed order, so there are no atomics and results are bit-for-bit
// repeatable. With P = exp(scale q.k - lse), dP = dout.v:
//   dS = P (dP - delta);  dq = scale dS k;  dk = scale dS^T q;  dv = P^T dout.
// A row that sees no key visits no key (and no key counts it among its
// queries), so its lse = -inf is never used and it gets zero gradient.
#include <metal_stdlib>

#include "flash_device.h"

using namespace metal;

// delta[b, h, i] = sum_d dout[b, i, h, d] * o[b, i, h, d]. One thread per
// row; O(T D) work, negligible next to the O(T^2 D) kernels.
// Threadgroup memory: none.
kernel void flash_bwd_preprocess_f32(device const float* dout [[buffer(0)]],
                                     device const float* o [[buffer(1)]],
                                     device float* delta [[buffer(2)]],
                                     constant FlashParams& p [[buffer(3)]],
                                     uint3 grid_pos [[threadgroup_position_in_grid]],
                                     uint tid [[thread_index_in_threadgroup]]) {
    const uint3 group_pos = fa_group_position(grid_pos, p);
    const int h = int(group_pos.y);
    const int b = int(group_pos.z);
    const int i = int(group_pos.x) * FA_ROWS_PER_GROUP + int(tid);
    if (i >= p.Tq) return;
    const fa_long go = fa_offset(p.dout.b, p.dout.t, p.dout.h, b, i, h);
    const fa_long oo = fa_offset(p.o.b, p.o.t, p.o.h, b, i, h);
    float sum = 0.0f;
    for (int d = 0; d < p.D; ++d) sum = fma(dout[go + d], o[oo + d], sum);
    delta[(fa_long(b) * p.H + h) * p.Tq + i] = sum;
}

// dq for FA_ROWS_PER_GROUP query rows of one (batch, head); K and V staged
// through threadgroup memory exactly as in the forward.
// Threadgroup memory: Ks + Vs = 2 * FA_TILE(HD) * HD floats (<= 16 KiB).
template <int HD>
kernel void flash_bwd_dq(device const float* q [[buffer(0)]],
                         device const float* k [[buffer(1)]],
                         device const float* v [[buffer(2)]],
                         device const float* dout [[buffer(3)]],
                         device const float* lse [[buffer(4)]],
                         device const float* delta [[buffer(5)]],
                         device float* dq [[buffer(6)]],
                         constant FlashParams& p [[buffer(7)]],
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

    const fa_long group_begin = fa_key_begin(row0, p.Tq, p.Tk, p.window_left);
    const fa_long group_end = fa_key_end(last_row, p.Tq, p.Tk, p.window_right);
    const fa_long row_begin = active ? fa_key_begin(i, p.Tq, p.Tk, p.window_left) : 0;
    const fa_long row_end = active ? fa_key_end(i, p.Tq, p.Tk, p.window_right) : 0;

    float qr[HD];
    float gr[HD];
    float acc[HD];
    const fa_long qo = fa_offset(p.q.b, p.q.t, p.q.h, b, i, h);
    const fa_long go = fa_offset(p.dout.b, p.dout.t, p.dout.h, b, i, h);
    for (int d = 0; d < D; ++d) {
        qr[d] = active ? q[qo + d] : 0.0f;
        gr[d] = active ? dout[go + d] : 0.0f;
        acc[d] = 0.0f;
    }
    const fa_long stat = (fa_long(b) * p.H + h) * p.Tq + i;
    // Only read when the row sees a key: then lse is finite.
    const float row_lse = row_begin < row_end ? lse[stat] : 0.0f;
    const float row_delta = row_begin < row_end ? delta[stat] : 0.0f;

    for (fa_long j0 = group_begin; j0 < group_end; j0 += TILE) {
        const int n = int(group_end - j0 < TILE ? group_end - j0 : TILE);

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
            threadgroup const float* vj = Vs + r * HD;
            float s = 0.0f;
            float dp = 0.0f;
            for (int d = 0; d < D; ++d) {
                s = fma(qr[d], kj[d], s);
                dp = fma(gr[d], vj[d], dp);
            }
            const float prob = exp(s * p.scale - row_lse);
            const float ds = prob * (dp - row_delta);
            for (int d = 0; d < D; ++d) acc[d] = fma(ds, kj[d], acc[d]);
        }
    }

    if (!active) return;
    const fa_long out = fa_offset(p.dq.b, p.dq.t, p.dq.h, b, i, h);
    for (int d = 0; d < D; ++d) dq[out + d] = acc[d] * p.scale;
}

// dk and dv for FA_ROWS_PER_GROUP key rows of one (batch, kv head), summed
// over the `group` query heads that share the kv head and over the query rows
// that see each key. Fused: the q.k product and P are computed once for both.
// Threadgroup memory: Qs + Gs = 2 * FA_TILE(HD) * HD floats, plus
// 2 * FA_TILE(HD) for lse and delta (<= 16.1 KiB).
template <int HD>
kernel void flash_bwd_dkdv(device const float* q [[buffer(0)]],
                           device const float* k [[buffer(1)]],
                           device const float* v [[buffer(2)]],
                           device const float* dout [[buffer(3)]],
                           device const float* lse [[buffer(4)]],
                           device const float* delta [[buffer(5)]],
                           device float* dk [[buffer(6)]],
                           device float* dv [[buffer(7)]],
                           constant FlashParams& p [[buffer(8)]],
                           uint3 grid_pos [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]]) {
    const uint3 group_pos = fa_group_position(grid_pos, p);
    const int TILE = FA_TILE(HD);
    FA_TG_ARRAY(float, Qs, FA_TILE(HD) * HD);
    FA_TG_ARRAY(float, Gs, FA_TILE(HD) * HD);
    FA_TG_ARRAY(float, Ls, FA_TILE(HD));
    FA_TG_ARRAY(float, Ds, FA_TILE(HD));

    const int D = p.D;
    const int hkv = int(group_pos.y);
    const int b = int(group_pos.z);
    const int col0 = int(group_pos.x) * FA_ROWS_PER_GROUP;
    const int j = col0 + int(tid);
    const bool active = j < p.Tk;
    const int last_col = min(col0 + FA_ROWS_PER_GROUP, p.Tk) - 1;

    // Query rows that see any key of the group, and those that see key j.
    const fa_long group_begin = fa_query_begin(col0, p.Tq, p.Tk, p.window_right);
    const fa_long group_end = fa_query_end(last_col, p.Tq, p.Tk, p.window_left);
    const fa_long col_begin = active ? fa_query_begin(j, p.Tq, p.Tk, p.window_right) : 0;
    const fa_long col_end = active ? fa_query_end(j, p.Tq, p.Tk, p.window_left) : 0;

    float kr[HD];
    float vr[HD];
    float dk_acc[HD];
    float dv_acc[HD];
    const fa_long ko = fa_offset(p.k.b, p.k.t, p.k.h, b, j, hkv);
    const fa_long vo = fa_offset(p.v.b, p.v.t, p.v.h, b, j, hkv);
    for (int d = 0; d < D; ++d) {
        kr[d] = active ? k[ko + d] : 0.0f;
        vr[d] = active ? v[vo + d] : 0.0f;
        dk_acc[d] = 0.0f;
        dv_acc[d] = 0.0f;
    }

    for (int g = 0; g < p.group; ++g) {
        const int h = hkv * p.group + g;
        const fa_long stat0 = (fa_long(b) * p.H + h) * p.Tq;
        for (fa_long i0 = group_begin; i0 < group_end; i0 += TILE) {
            const int n = int(group_end - i0 < TILE ? group_end - i0 : TILE);

            threadgroup_barrier(mem_flags::mem_threadgroup);
            for (int e = int(tid); e < n * D; e += FA_ROWS_PER_GROUP) {
                const int r = e / D;
                const int d = e - r * D;
                Qs[r * HD + d] = q[fa_offset(p.q.b, p.q.t, p.q.h, b, i0 + r, h) + d];
                Gs[r * HD + d] = dout[fa_offset(p.dout.b, p.dout.t, p.dout.h, b, i0 + r, h) + d];
            }
            for (int r = int(tid); r < n; r += FA_ROWS_PER_GROUP) {
                Ls[r] = lse[stat0 + i0 + r];
                Ds[r] = delta[stat0 + i0 + r];
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);

            if (!active) continue;
            for (int r = 0; r < n; ++r) {
                const fa_long i = i0 + r;
                if (i < col_begin || i >= col_end) continue;
                threadgroup const float* qi = Qs + r * HD;
                threadgroup const float* gi = Gs + r * HD;
                float s = 0.0f;
                float dp = 0.0f;
                for (int d = 0; d < D; ++d) {
                    s = fma(qi[d], kr[d], s);
                    dp = fma(gi[d], vr[d], dp);
                }
                const float prob = exp(s * p.scale - Ls[r]);
                const float ds = prob * (dp - Ds[r]);
                for (int d = 0; d < D; ++d) {
                    dv_acc[d] = fma(prob, gi[d], dv_acc[d]);
                    dk_acc[d] = fma(ds, qi[d], dk_acc[d]);
                }
            }
        }
    }

    if (!active) return;
    const fa_long ko_out = fa_offset(p.dk.b, p.dk.t, p.dk.h, b, j, hkv);
    const fa_long vo_out = fa_offset(p.dv.b, p.dv.t, p.dv.h, b, j, hkv);
    for (int d = 0; d < D; ++d) {
        dk[ko_out + d] = dk_acc[d] * p.scale;
        dv[vo_out + d] = dv_acc[d];
    }
}

#define FA_INSTANTIATE_BWD(HD)                                                                 \
    template FA_HOST_NAME("flash_bwd_dq_f32_hd" #HD) kernel void flash_bwd_dq<HD>(             \
        device const float*, device const float*, device const float*, device const float*,    \
        device const float*, device const float*, device float*, constant FlashParams&, uint3,  \
        uint);                                                                                  \
    template FA_HOST_NAME("flash_bwd_dkdv_f32_hd" #HD) kernel void flash_bwd_dkdv<HD>(         \
        device const float*, device const float*, device const float*, device const float*,    \
        device const float*, device const float*, device float*, device float*,                \
        constant FlashParams&, uint3, uint);

FA_HEAD_BUCKETS(FA_INSTANTIATE_BWD)
