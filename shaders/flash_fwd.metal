// Fused attention forward on simdgroup matrices: o = softmax(scale q k^T,
// masked) v and the per-row log-sum-exp, without ever writing a T^2 matrix.
//
// Work split (MLX steel attention, metal-flash-attention): a threadgroup of
// FA_SIMDGROUPS SIMD groups owns FA_BLOCK_ROWS query rows of one kv head
// (and FA_FWD_DCHUNK(HD) columns of o: grid.y = Hkv * HD / chunk)
// (the packed numbering of FlashParams::rows_per_head: in decode the query
// heads of a GQA group share the block, so each K/V row is read once per kv
// head); each SIMD group owns 8 of them. K and V blocks of FA_FWD_STAGE(HD, T) keys
// are staged in threadgroup memory, zero-padded to the bucket; per block a
// SIMD group computes S = Q K^T (8 x FA_STAGE fragments), the online softmax
// on S's fragments (row reductions by two shuffles; exp2 of score
// differences times log2(e)), and O += P V (8 x HD fragments, in registers
// for the whole kernel). A tile is skipped, computed unmasked or masked per
// element (fa_classify), so cost follows the causal/window band.
//
// Split-KV (FlashParams::kv_splits > 1, decode with few threadgroups): the
// key range is cut into kv_splits chunks, grid.z = B * kv_splits; each
// chunk writes its normalised o and lse to the partial_o / partial_lse
// float32 scratch bound in place of o and lse, and flash_fwd_merge_{dtype}
// combines them exactly.
//
// Storage types (issue 15): every kernel is a template of T = float, half
// or bfloat, the type of q, k, v and o (host names flash_fwd_{f32,f16,bf16}
// _hd{HD}); K and V are staged as T, converted to float32 fragments as they
// are loaded; S, P, m, l and O are float32; o is rounded to T once.
//
// Online softmax (FlashAttention-2): m = running max (starts at -FLT_MAX, so
// the weight of a masked -inf score is 0 and never NaN), l = running sum, O
// unnormalised, P = exp2((S - m) log2(e)). Scores stay in natural units, Q
// scaled by `scale` only: the backward recomputes S bit for bit and
// subtracts the natural-log lse before the same conversion, so a row whose
// softmax is one-hot gets P = exp2(0) = 1 exactly even at scores of 1e5
// (folding log2(e) into Q would need lse in log2 units, and converting lse
// costs an ulp of the score: 1% of P there). A row that sees no key, or whose every score
// is -inf, gets o = 0 and lse = -inf; NaN and +inf scores propagate as IEEE
// says (fmax ignores a NaN, but exp2(NaN) poisons l and O).
#include <metal_stdlib>

#include "flash_device.h"

template <int HD, class T>
FA_MAX_THREADS(FA_THREADS) kernel void flash_fwd(device const T* q [[buffer(0)]],
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
    const int BK = FA_FWD_STAGE(HD, T);
    const int LD = FA_LD(HD, T);
    FA_TG_ARRAY(T, Ks, FA_FWD_STAGE(HD, T) * FA_LD(HD, T));
    FA_TG_ARRAY(T, Vs, FA_FWD_STAGE(HD, T) * FA_LD(HD, T));
    FA_TG_ARRAY(int, Again, 1);  // a SIMD group asks for the exact pass (fa_leaked)

    const int DC = FA_FWD_DCHUNK(HD);
    const uint3 pos = fa_group_position(grid_pos, p);
    const int hkv = int(pos.y) / (HD / DC);
    const int c0 = (int(pos.y) % (HD / DC)) * DC;  // this threadgroup's columns of o
    const int b = int(pos.z) % p.B;
    const int split = int(pos.z) / p.B;
    const int r0 = int(pos.x) * FA_BLOCK_ROWS;
    const FaLane at = fa_lane(lane);
    const FaSeq seq = fa_sequence(p, seqs, b, fa_is_varlen());
    const int Tq = seq.Tq, Tk = seq.Tk;

    // This lane's query row (shared with lanes ^1, ^8, ^9) and its keys.
    const FaQueryRow row = fa_query_row(p, Tq, hkv, r0 + int(sg) * 8 + at.row);
    int row_begin = 0x3fffffff, row_end = 0;
    if (row.valid) {
        row_begin = int(fa_key_begin(row.t, Tq, Tk, p.window_left));
        row_end = int(fa_key_end(row.t, Tq, Tk, p.window_right));
    }
    // Keys any row of the threadgroup sees (uniform: every thread meets the
    // same barriers), cut to this split's chunk.
    int t_lo, t_hi;
    fa_row_span(p, Tq, r0, FA_BLOCK_ROWS, t_lo, t_hi);
    // Varlen: a block past this sequence's rows has nothing to do. (A
    // sequence without keys runs on: no tile, so o = 0 and lse = the sink or
    // -inf, the values core/varlen.cpp gives; the metal host may copy o and
    // lse back from a buffer the kernels alone wrote.)
    if (fa_is_varlen() && t_lo > t_hi) return;
    int group_begin = int(fa_key_begin(t_lo, Tq, Tk, p.window_left));
    int group_end = int(fa_key_end(t_hi, Tq, Tk, p.window_right));
    if (p.kv_splits > 1) {
        fa_split_keys(p, Tk, split, group_begin, group_end);
        // Each row sees only this chunk's keys (the tile classification
        // then masks the zero rows staged past its end).
        row_begin = max(row_begin, group_begin);
        row_end = min(row_end, group_end);
    }

    FaRowFragments<HD, FA_FWD_Q_IN_REGISTERS(HD, T), T> Q;
    Q.load(row.valid ? q + fa_row_offset(p.q.b, p.q.t, p.q.h, b, seq.q0, row.t, row.h, fa_is_varlen()) : nullptr, at.col, p.D,
           p.scale);

    // Used only with options. A row past the group's heads (row.valid false)
    // takes head 0's: its own slope would be read past the end of the array.
    const FaScoreMods mods =
        fa_score_mods_of(sp, alibi, b, row.valid ? row.h : 0, fa_long(row.t) * sp.mask_i);
    const bool sink = (fa_score_mods & FA_SCORE_SINKS) && split == 0 && row.valid &&
                      sinks[row.h] != -INFINITY;

    device const T* k_head = k + fa_row_offset(p.k.b, p.k.t, p.k.h, b, seq.k0, 0, hkv, fa_is_varlen());
    device const T* v_head = v + fa_row_offset(p.v.b, p.v.t, p.v.h, b, seq.k0, 0, hkv, fa_is_varlen());
    fa_frag O[DC / 8];
    float m, l;
    // Two passes at most: the first multiplies every tile; if a NaN or inf
    // may have reached a row through a masked zero (fa_leaked), the whole
    // loop runs again, tiles some row does not fully see taking the exact
    // path. Only inputs holding a NaN or an inf ever cost the second pass.
    if (tid == 0) Again[0] = 0;
    for (bool exact_pass = false;; exact_pass = true) {
        FA_UNROLL
        for (int d8 = 0; d8 < DC / 8; ++d8) O[d8] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        m = -FLT_MAX;
        l = 0.0f;
        // A sink is one more logit with a zero value: it starts the row's max
        // and sum. With split-KV only the first chunk counts it (the merge adds
        // the chunks' sums, so the sink joins the denominator once).
        if (sink) {
            m = sinks[row.h];
            l = 1.0f;
        }
        bool leaked = false;
        for (int j0 = group_begin; j0 < group_end; j0 += BK) {
            const int n = min(BK, group_end - j0);
            // Nobody may still be reading the previous block.
            threadgroup_barrier(mem_flags::mem_threadgroup);
            fa_stage<HD, FA_FWD_STAGE(HD, T), FA_THREADS>(Ks, k_head + fa_long(j0) * p.k.t, p.k.t, n, p.D,
                                                   tid);
            fa_stage<HD, FA_FWD_STAGE(HD, T), FA_THREADS>(Vs, v_head + fa_long(j0) * p.v.t, p.v.t, n, p.D,
                                                   tid);
            threadgroup_barrier(mem_flags::mem_threadgroup);

            const FaTile tile = fa_classify(row_begin, row_end, j0, BK);
            if (tile == fa_tile_skip) continue;
            if (fa_has_mask() &&
                fa_mask_hides_tile<BK>(mods, mask, j0, row_begin, row_end, at.col, sp.mask_j))
                continue;  // the mask hides this block from the group's rows
            // Some row does not see some key of the tile (cut off by the band,
            // or hidden by the mask): a NaN or inf in V must not reach it.
            const bool cut = tile == fa_tile_masked || fa_has_mask();

            // S = Q K^T, K^T's fragment (d8, k8) the transposed load of Ks.
            fa_frag S[BK / 8];
            fa_rows_times_tile<HD, BK, FA_S_PARTIALS, false>(S, Q, Ks, LD, 1.0f);
            if (!FaPrecision<T>::scale_q()) fa_scale_scores(S, p.scale);

            // Online softmax on the lane's elements of its row.
            float tile_max = -INFINITY;
            FA_UNROLL
            for (int k8 = 0; k8 < BK / 8; ++k8) {
                FA_UNROLL
                for (int i = 0; i < 2; ++i) {
                    const int j = j0 + k8 * 8 + at.col + i;
                    float s = S[k8].thread_elements()[i];
                    const bool seen = tile != fa_tile_masked || (j >= row_begin && j < row_end);
                    if (!seen) s = -INFINITY;
                    float dcap;
                    if (fa_score_mods != 0 && seen)
                        s = fa_score_mod(seq, sp, mods, mask, row.t, j, fa_long(j) * sp.mask_j, s, dcap);
                    S[k8].thread_elements()[i] = s;
                    tile_max = max(tile_max, s);
                }
            }
            const float m_new = max(m, fa_row_max(tile_max));
            const float factor = exp2((m - m_new) * M_LOG2E_F);
            // P, rounded to its operand type (FaPrecision); l sums it
            // unrounded, so lse is as exact as float32 makes it.
            fa_op<typename FaPrecision<T>::P> P[BK / 8];
            float tile_sum = 0.0f;
            FA_UNROLL
            for (int k8 = 0; k8 < BK / 8; ++k8) {
                FA_UNROLL
                for (int i = 0; i < 2; ++i) {
                    const float e = exp2((S[k8].thread_elements()[i] - m_new) * M_LOG2E_F);
                    P[k8].thread_elements()[i] = typename FaPrecision<T>::P(e);
                    tile_sum += e;
                }
            }
            l = l * factor + fa_row_sum(tile_sum);
            m = m_new;

            // O = O * factor + P V, on this threadgroup's columns.
            FA_UNROLL
            for (int d8 = 0; d8 < DC / 8; ++d8) {
                O[d8].thread_elements()[0] *= factor;
                O[d8].thread_elements()[1] *= factor;
            }
            if (exact_pass && cut) {
                fa_masked_accumulate(O, P, Vs + c0, LD, at, j0, row_begin, row_end,
                                     FaMaskRow{mods, mask, sp.mask_j, fa_has_mask()});
                continue;
            }
            FA_UNROLL
            for (int d8 = 0; d8 < DC / 8; ++d8) {
                FA_UNROLL
                for (int k8 = 0; k8 < BK / 8; ++k8) {
                    fa_op<T> vf;
                    simdgroup_load(vf, Vs + k8 * 8 * LD + c0 + d8 * 8, ulong(LD), ulong2(0, 0), false);
                    simdgroup_multiply_accumulate(O[d8], P[k8], vf, O[d8]);
                }
            }
            if (cut && !exact_pass) leaked = leaked || fa_leaked(O, row.valid);
        }
        if (exact_pass) break;
        if (leaked && lane == 0) Again[0] = 1;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (Again[0] == 0) break;
    }

    if (!row.valid || c0 + at.col >= p.D) return;
    // l == 0: no key seen (or every score -inf): o = 0, lse = -inf. A NaN l
    // is not 0, so NaN reaches o and lse.
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    const float row_lse = l == 0.0f ? -INFINITY : m + log(l);
    fa_long lse_at;
    if (p.kv_splits > 1) {
        // This chunk's partial result, float32 whatever T (the merge rounds
        // once): the plan binds float scratch at buffer(3).
        device float* part = reinterpret_cast<device float*>(o) + fa_partial_o_at(p, split, b, row.t, row.h);
        fa_store_row(part, O, c0, at.col, p.D, inv);
        lse_at = fa_partial_lse_at(p, split, b, row.t, row.h);
    } else {
        fa_store_row(o + fa_row_offset(p.o.b, p.o.t, p.o.h, b, seq.q0, row.t, row.h, fa_is_varlen()), O, c0, at.col, p.D, inv);
        lse_at = fa_stat_row0(p, seq, b, row.h, fa_is_varlen()) + row.t;
    }
    // One lane per row of the first column chunk writes the row's lse
    // (lanes ^1, ^8, ^9 share it; every chunk computed the same m and l).
    if (c0 == 0 && at.col == 0) lse[lse_at] = row_lse;
}

// The split-KV merge: o = sum_s exp(lse_s - lse) o_s with lse = log sum_s
// exp(lse_s), from the chunks' partial results. One SIMD group per (b, h, t)
// row, lane s holding chunk s; a row no chunk saw gets o = 0, lse = -inf.
// The partials are float32; o is written in the input's type T.
template <class T>
kernel void flash_fwd_merge(device const float* partial_o [[buffer(0)]],
                            device const float* partial_lse [[buffer(1)]],
                            device T* o [[buffer(2)]],
                            device float* lse [[buffer(3)]],
                            constant FlashParams& p [[buffer(4)]],
                            uint3 grid_pos [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]]) {
    (void)tid;
    const uint3 pos = fa_group_position(grid_pos, p);
    const fa_long rows = fa_long(p.B) * p.H * p.Tq;
    const fa_long r = fa_long(pos.x) * FA_MERGE_ROWS_PER_GROUP + sg;  // (b * H + h) * Tq + t
    if (r >= rows) return;  // uniform across the SIMD group
    const int t = int(r % p.Tq);
    const int h = int(r / p.Tq % p.H);
    const int b = int(r / (fa_long(p.Tq) * p.H));

    const bool mine = int(lane) < p.kv_splits;
    const float part_lse = mine ? partial_lse[fa_partial_lse_at(p, int(lane), b, t, h)] : -INFINITY;
    const float top = simd_max(part_lse);
    // exp(-inf - top) = 0 for a chunk that saw no key; top = -inf: none did.
    const float w = top == -INFINITY ? 0.0f : exp(part_lse - top);
    const float total = simd_sum(w);
    if (lane == 0) lse[r] = top == -INFINITY ? -INFINITY : top + log(total);
    const float inv = top == -INFINITY ? 0.0f : 1.0f / total;

    device T* out = o + fa_offset(p.o.b, p.o.t, p.o.h, b, t, h);
    for (int d0 = 0; d0 < p.D; d0 += FA_SIMD_WIDTH) {
        const int d = d0 + int(lane);
        float acc = 0.0f;
        for (int s = 0; s < p.kv_splits; ++s) {
            const float ws = simd_shuffle(w, ushort(s));
            const float x = d < p.D ? partial_o[fa_partial_o_at(p, s, b, t, h) + d] : 0.0f;
            acc = fma(ws, x, acc);
        }
        if (d < p.D) out[d] = T(acc * inv);
    }
}

#define FA_INSTANTIATE_FWD(NAME, T, HD)                                                     \
    template FA_HOST_NAME("flash_fwd_" #NAME "_hd" #HD) kernel void flash_fwd<HD, T>(      \
        device const T*, device const T*, device const T*, device T*, device float*,        \
        constant FlashParams&, constant FlashScoreParams&, device const float*,              \
        device const uchar*, device const float*, device const int*, uint3, uint, uint, uint);
#define FA_INSTANTIATE_FWD_TYPES(HD) FA_STORAGE_TYPES(FA_INSTANTIATE_FWD, HD)
FA_HEAD_BUCKETS(FA_INSTANTIATE_FWD_TYPES)

#define FA_INSTANTIATE_MERGE(NAME, T, UNUSED)                                                \
    template FA_HOST_NAME("flash_fwd_merge_" #NAME) kernel void flash_fwd_merge<T>(        \
        device const float*, device const float*, device T*, device float*,                  \
        constant FlashParams&, uint3, uint, uint, uint);
FA_STORAGE_TYPES(FA_INSTANTIATE_MERGE, 0)
