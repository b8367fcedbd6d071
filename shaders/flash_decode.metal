// The forward for a few query rows per kv head (decode): one query row per
// threadgroup, as vectors, with no simdgroup matrices.
//
// Why: the tiled forward (flash_fwd.metal) gives a threadgroup 32 query
// rows of one kv head; in MHA decode a head has Tq of them, often 1, so
// at least three of its four SIMD groups multiply zero rows and the
// fourth spends 8-row MMAs on one row. Here, as llama.cpp's
// kernel_flash_attn_ext_vec and MLX's sdpa_vector do, a lane holds HD / 32
// consecutive elements of q and of the output row; a SIMD group takes one
// key at a time (its score a simd_sum of the lanes' partial dot products)
// and the FA_DECODE_SIMDGROUPS SIMD groups of the threadgroup take every
// FA_DECODE_SIMDGROUPS-th key, each with its own online softmax, merged at
// the end through threadgroup memory (MLX's sdpa_vector merges so). K and V
// go from device memory straight to registers: each key is read once per
// query row, the traffic decode is bound by.
//
// The plan takes this kernel for MHA with at most FA_DECODE_MAX_ROWS query
// rows (core/plan.h, uses_decode_kernel); grid (Tq, H, B * kv_splits), a
// varlen batch's grid.z the sequence. Split-KV writes the same float32
// partials as the tiled kernel, merged by flash_fwd_merge.
//
// The numbers are the tiled forward's: scores in float32 (16-bit q and k
// multiplied exactly in float32, then scaled; float32 q scaled as it is
// loaded), the options applied by fa_score_mod, m starting at -FLT_MAX,
// o and lse of a row that sees no key 0 and -inf. A key the band or the
// mask hides is skipped, never multiplied by a zero weight, so a NaN or
// inf in its k or v reaches no row (the README's rule, with no second pass).
#include <metal_stdlib>

#include "flash_device.h"

template <int HD, class T>
FA_MAX_THREADS(FA_DECODE_THREADS) kernel void flash_decode(device const T* q [[buffer(0)]],
                         device const T* k [[buffer(1)]],
                         device const T* v [[buffer(2)]],
                         device T* o [[buffer(3)]],  // float partial_o with split-KV
                         device float* lse [[buffer(4)]],
                         constant FlashParams& p [[buffer(5)]],
                         constant FlashScoreParams& sp [[buffer(6)]],
                         device const float* alibi [[buffer(7)]],
                         device const uchar* mask [[buffer(8)]],
                         device const float* sinks [[buffer(9)]],
                         device const int* seqs [[buffer(10)]],  // varlen: cu_seqlens_q, cu_seqlens_k
                         uint3 grid_pos [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]]) {
    const int E = HD / FA_SIMD_WIDTH;  // elements of q, k, v and o per lane
    const int SG = FA_DECODE_SIMDGROUPS;
    FA_TG_ARRAY(float, Ms, FA_DECODE_SIMDGROUPS);
    FA_TG_ARRAY(float, Ls, FA_DECODE_SIMDGROUPS);
    FA_TG_ARRAY(float, Os, FA_DECODE_SIMDGROUPS * HD);

    const uint3 pos = fa_group_position(grid_pos, p);
    const int t = int(pos.x);
    const int h = int(pos.y);
    const int hkv = h / p.group;
    const int b = int(pos.z) % p.B;
    const int split = int(pos.z) / p.B;
    const FaSeq seq = fa_sequence(p, seqs, b, fa_is_varlen());
    // Uniform over the threadgroup: a row past this sequence's has no work.
    if (t >= seq.Tq) return;

    int begin = int(fa_key_begin(t, seq.Tq, seq.Tk, p.window_left));
    int end = int(fa_key_end(t, seq.Tq, seq.Tk, p.window_right));
    if (p.kv_splits > 1) fa_split_keys(p, seq.Tk, split, begin, end);

    // The lane's columns [d0, d0 + E); past D they hold zero and are not written.
    const int d0 = int(lane) * E;
    const bool scale_q = FaPrecision<T>::scale_q();
    device const T* q_row = q + fa_row_offset(p.q.b, p.q.t, p.q.h, b, seq.q0, t, h, fa_is_varlen());
    float qv[E], acc[E];
    FA_UNROLL
    for (int i = 0; i < E; ++i) {
        const bool in = fa_head_full || d0 + i < p.D;
        qv[i] = in ? (scale_q ? float(q_row[d0 + i]) * p.scale : float(q_row[d0 + i])) : 0.0f;
        acc[i] = 0.0f;
    }
    const FaScoreMods mods = fa_score_mods_of(sp, alibi, b, h, fa_long(t) * sp.mask_i);
    device const T* k_head = k + fa_row_offset(p.k.b, p.k.t, p.k.h, b, seq.k0, 0, hkv, fa_is_varlen());
    device const T* v_head = v + fa_row_offset(p.v.b, p.v.t, p.v.h, b, seq.k0, 0, hkv, fa_is_varlen());

    // A sink (one more logit with a zero value) starts one running softmax
    // of the row: SIMD group 0's of the first chunk, so the merges count it once.
    float m = -FLT_MAX, l = 0.0f;
    if ((fa_score_mods & FA_SCORE_SINKS) && split == 0 && sg == 0 && sinks[h] != -INFINITY) {
        m = sinks[h];
        l = 1.0f;
    }
    for (int j = begin + int(sg); j < end; j += SG) {
        // Uniform over the SIMD group (one key): a hidden key is skipped.
        if (fa_has_mask() && fa_mask_hides(mods, mask, fa_long(j) * sp.mask_j)) continue;
        device const T* k_row = k_head + fa_long(j) * p.k.t;
        float part = 0.0f;
        FA_UNROLL
        for (int i = 0; i < E; ++i)
            if (fa_head_full || d0 + i < p.D) part = fma(qv[i], float(k_row[d0 + i]), part);
        float s = simd_sum(part);
        if (!scale_q) s *= p.scale;
        if (fa_score_mods != 0) {
            float dcap;
            s = fa_score_mod(seq, sp, mods, mask, t, j, fa_long(j) * sp.mask_j, s, dcap);
        }
        const float m_new = max(m, s);
        const float factor = exp2((m - m_new) * M_LOG2E_F);
        const float e = exp2((s - m_new) * M_LOG2E_F);
        l = fma(l, factor, e);
        m = m_new;
        device const T* v_row = v_head + fa_long(j) * p.v.t;
        FA_UNROLL
        for (int i = 0; i < E; ++i) {
            const float x = fa_head_full || d0 + i < p.D ? float(v_row[d0 + i]) : 0.0f;
            acc[i] = fma(e, x, acc[i] * factor);
        }
    }

    // Merge the SIMD groups' softmaxes: weights exp(m_s - max m); a group
    // that saw no key has l = 0 and o = 0, and adds nothing.
    if (lane == 0) {
        Ms[sg] = m;
        Ls[sg] = l;
    }
    FA_UNROLL
    for (int i = 0; i < E; ++i) Os[int(sg) * HD + d0 + i] = acc[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float top = -FLT_MAX;
    FA_UNROLL
    for (int s = 0; s < SG; ++s) top = max(top, Ms[s]);
    float w[FA_DECODE_SIMDGROUPS];
    float total = 0.0f;
    FA_UNROLL
    for (int s = 0; s < SG; ++s) {
        w[s] = exp2((Ms[s] - top) * M_LOG2E_F);
        total = fma(Ls[s], w[s], total);
    }
    // total == 0: no key seen (or every score -inf): o = 0, lse = -inf. A
    // NaN total is not 0, so NaN reaches o and lse.
    const float inv = total == 0.0f ? 0.0f : 1.0f / total;
    device T* out_t = nullptr;
    device float* out_f = nullptr;
    fa_long lse_at;
    if (p.kv_splits > 1) {
        // This chunk's partial result, float32: the plan binds float
        // scratch at buffer(3).
        out_f = reinterpret_cast<device float*>(o) + fa_partial_o_at(p, split, b, t, h);
        lse_at = fa_partial_lse_at(p, split, b, t, h);
    } else {
        out_t = o + fa_row_offset(p.o.b, p.o.t, p.o.h, b, seq.q0, t, h, fa_is_varlen());
        lse_at = fa_stat_row0(p, seq, b, h, fa_is_varlen()) + t;
    }
    for (int d = int(tid); d < p.D; d += FA_DECODE_THREADS) {
        float x = 0.0f;
        FA_UNROLL
        for (int s = 0; s < SG; ++s) x = fma(w[s], Os[s * HD + d], x);
        if (out_f) out_f[d] = x * inv;
        else out_t[d] = T(x * inv);
    }
    if (tid == 0) lse[lse_at] = total == 0.0f ? -INFINITY : top + log(total);
}

#define FA_INSTANTIATE_DECODE(NAME, T, HD)                                                    \
    template FA_HOST_NAME("flash_decode_" #NAME "_hd" #HD) kernel void flash_decode<HD, T>(  \
        device const T*, device const T*, device const T*, device T*, device float*,          \
        constant FlashParams&, constant FlashScoreParams&, device const float*,                \
        device const uchar*, device const float*, device const int*, uint3, uint, uint, uint);
#define FA_INSTANTIATE_DECODE_TYPES(HD) FA_STORAGE_TYPES(FA_INSTANTIATE_DECODE, HD)
FA_HEAD_BUCKETS(FA_INSTANTIATE_DECODE_TYPES)
