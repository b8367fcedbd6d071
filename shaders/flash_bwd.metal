// Fused attention backward on simdgroup matrices (FlashAttention-2 math,
// metal-flash-attention's split: no atomics), three kernels run in this
// order by plan_backward:
//   flash_bwd_preprocess_{dt}    delta = rowsum(dout * o), one float per row
//   flash_bwd_dq_{dt}_hd{HD}     dq: a threadgroup per block of query rows
//   flash_bwd_dkdv_{dt}_hd{HD}   dk, dv: a threadgroup per block of key rows,
//                                summed over the query heads of its kv head
// ({dt}: f32, f16, bf16, the storage type T of q, k, v, o, dout and the
// gradients; staged tiles hold T, fragments and accumulators are float32,
// lse and delta float32, dq, dk, dv rounded to T once. P and dS stay
// float32: they are never rounded to T before their products.)
// Probabilities are recomputed tile by tile from q, k and the forward's lse,
// never stored. Every gradient element is owned by one SIMD group that sums
// in a fixed order, so results are bit-for-bit repeatable. With S = (scale
// q).k recomputed exactly as the forward computed it:
//   P = exp2((S - lse) log2(e));  dP = dout v^T;  dS = P (dP - delta);
//   dq = scale dS k;  dk = dS^T (scale q);  dv = P^T dout.
// The dK/dV kernel works on the transposes (S^T = K Q^T, metal-flash-
// attention's formulation), so each SIMD group owns 8 keys' dK and dV rows.
// A row that saw no key (lse = -inf) contributes nothing: its lse is taken
// as +inf, so P = exp2(-inf) = 0 wherever its scores are finite or -inf.
#include <metal_stdlib>

#include "flash_device.h"

// delta[b, h, i] = sum_d dout[b, i, h, d] * o[b, i, h, d]. One thread per
// row, reading 16-byte vectors; O(T D) work, negligible next to the O(T^2
// D) kernels. Summed as the
// kernels' matrix products sum dP = dO V^T: FA_DP_PARTIALS chains, chain s
// taking the 8-column blocks d / 8 = s (mod FA_DP_PARTIALS) in order, added
// at the end, so that a saturated row's dP - delta is exactly 0.
template <class T>
kernel void flash_bwd_preprocess(device const T* dout [[buffer(0)]],
                                 device const T* o [[buffer(1)]],
                                 device float* delta [[buffer(2)]],
                                 constant FlashParams& p [[buffer(3)]],
                                 device const int* seqs [[buffer(4)]],  // varlen: cu_seqlens
                                 uint3 grid_pos [[threadgroup_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]]) {
    const uint3 pos = fa_group_position(grid_pos, p);
    const int h = int(pos.y);
    const int b = int(pos.z);
    const int i = int(pos.x) * FA_PREPROCESS_THREADS + int(tid);
    // (No function constant here: this O(T D) kernel tests varlen_seqs.)
    const bool varlen = p.varlen_seqs > 0;
    const FaSeq seq = fa_sequence(p, seqs, b, varlen);
    if (i >= seq.Tq) return;
    const fa_long go = fa_row_offset(p.dout.b, p.dout.t, p.dout.h, b, seq.q0, i, h, varlen);
    const fa_long oo = fa_row_offset(p.o.b, p.o.t, p.o.h, b, seq.q0, i, h, varlen);
    // 16 bytes of each row at a time (fa_load16; a vector never crosses an
    // 8-column block), element by element past the last whole vector.
    const int V = FA_VEC16(T);
    float sum = 0.0f;
    FA_UNROLL
    for (int s = 0; s < FA_DP_PARTIALS; ++s) {
        float part = 0.0f;
        for (int d0 = 8 * s; d0 < p.D; d0 += 8 * FA_DP_PARTIALS) {
            for (int c = d0; c < min(d0 + 8, p.D); c += V) {
                if (c + V <= p.D) {
                    const FaVec16<T> x = fa_load16(dout + go + c), y = fa_load16(o + oo + c);
                    FA_UNROLL
                    for (int e = 0; e < V; ++e) part = fma(float(x.e[e]), float(y.e[e]), part);
                } else {
                    for (int d = c; d < p.D; ++d) part = fma(float(dout[go + d]), float(o[oo + d]), part);
                }
            }
        }
        sum = s == 0 ? part : sum + part;
    }
    delta[fa_stat_row0(p, seq, b, h, varlen) + i] = sum;
}

// The forward's lse of a row, +inf for a row that saw no key.
FA_INLINE float fa_row_lse(float lse) { return lse == -INFINITY ? INFINITY : lse; }

// A probability from a recomputed score and its row's lse.
FA_INLINE float fa_prob(float s, float lse) { return exp2((s - lse) * M_LOG2E_F); }

// The halves of a SIMD-group pair (FA_DQ_SPLIT, FA_DKDV_SPLIT) exchange
// their partial S and dP (S^T and dP^T in dK/dV): each lane puts its elements in `xs`, and after a barrier
// adds its partner's -- the same lane of SIMD group sg ^ 1, holding the
// same elements of the other parity's partial sum (tid ^ 32). part0 +
// part1 is what fa_rows_times_tile adds in one SIMD group: the same bits.
template <int N8>
FA_INLINE void fa_pair_put(threadgroup float* xs, const thread fa_frag (&a)[N8],
                           const thread fa_frag (&b)[N8], uint tid) {
    FA_UNROLL
    for (int n8 = 0; n8 < N8; ++n8) {
        FA_UNROLL
        for (int e = 0; e < 2; ++e) {
            xs[(n8 * 2 + e) * FA_THREADS + tid] = a[n8].thread_elements()[e];
            xs[((N8 + n8) * 2 + e) * FA_THREADS + tid] = b[n8].thread_elements()[e];
        }
    }
}
template <int N8>
FA_INLINE void fa_pair_add(threadgroup const float* xs, thread fa_frag (&a)[N8],
                           thread fa_frag (&b)[N8], uint tid) {
    const uint partner = tid ^ uint(FA_SIMD_WIDTH);
    FA_UNROLL
    for (int n8 = 0; n8 < N8; ++n8) {
        FA_UNROLL
        for (int e = 0; e < 2; ++e) {
            a[n8].thread_elements()[e] += xs[(n8 * 2 + e) * FA_THREADS + partner];
            b[n8].thread_elements()[e] += xs[((N8 + n8) * 2 + e) * FA_THREADS + partner];
        }
    }
}

// The dK/dV pairs' output rows (dK, then dV), stored through threadgroup
// memory: each lane puts its elements (rounded to T as fa_store_row rounds)
// at an index of its tid alone, as fa_pair_put does, the first half of its
// 8-column blocks in `lo`, the rest in `hi` (the Q and dO tiles: HD * 8
// elements each), and after a barrier the threads store the pairs' 16
// rows: row r at out + r * stride, the first `rows` of them, D columns. So
// no lane keeps its key's index or its fragment row live across the tile
// loop for the stores: with K and V in registers, float32 hd128 spilled
// such a value on the gate's proxy. (The even columns first, then the odd
// ones: one column after the other, the proxy kept tid's low bit from the
// loop for c % 2, and spilled it. A pair half holds N8 = HD / 16 blocks;
// the kernel instantiates this for its SPLIT = 1 buckets too, and never
// calls it there.)
template <int HD, class T, int N8>
FA_INLINE void fa_pair_store_rows(device T* out, fa_long stride, int rows, int D, threadgroup T* lo,
                                  threadgroup T* hi, const thread fa_frag (&a)[N8], uint tid,
                                  float scale) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tiles' last readers are done
    // (Each array by its own loop and load, not through a pointer chosen
    // between them: GCC 12's -O1 sanitizer build of metal-sim dropped the
    // stores made so.)
    FA_UNROLL
    for (int n8 = 0; n8 < N8 / 2; ++n8) {
        FA_UNROLL
        for (int e = 0; e < 2; ++e) {
            lo[(n8 * 2 + e) * FA_THREADS + tid] = T(a[n8].thread_elements()[e] * scale);
            hi[(n8 * 2 + e) * FA_THREADS + tid] = T(a[N8 / 2 + n8].thread_elements()[e] * scale);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    FA_UNROLL
    for (int e = 0; e < 2; ++e) {
        for (int i = int(tid); i < 8 * HD; i += FA_THREADS) {
            const int r = i / (HD / 2), c = i % (HD / 2) * 2 + e, n8 = c / 16;
            // The lane of SIMD group (pair r / 8, half c / 8 % 2) holding it.
            const int from = ((n8 % (N8 / 2)) * 2 + e) * FA_THREADS +
                             (r / 8 * 2 + c / 8 % 2) * FA_SIMD_WIDTH + fa_lane_of(r % 8, c % 8);
            if (r < rows && (fa_head_full || c < D)) out[r * stride + c] = n8 < N8 / 2 ? lo[from] : hi[from];
        }
    }
}

// dq for FA_DQ_ROWS(HD) query rows (packed numbering, as the forward) and
// FA_DQ_DCHUNK(HD) columns (grid.y = Hkv * HD / chunk); K and V staged
// through threadgroup memory exactly as in the forward. With FA_DQ_SPLIT =
// 2 a pair of SIMD groups holds 8 rows, each half every other 8-column
// block of Q, dO and dQ in registers, and the pair adds its partial S and
// dP (fa_pair_put), as the dK/dV kernel's pairs do.
template <int HD, class T>
FA_MAX_THREADS(FA_THREADS) kernel void flash_bwd_dq(device const T* q [[buffer(0)]],
                         device const T* k [[buffer(1)]],
                         device const T* v [[buffer(2)]],
                         device const T* dout [[buffer(3)]],
                         device const float* lse [[buffer(4)]],
                         device const float* delta [[buffer(5)]],
                         device T* dq [[buffer(6)]],
                         constant FlashParams& p [[buffer(7)]],
                         constant FlashScoreParams& sp [[buffer(8)]],
                         device const float* alibi [[buffer(9)]],
                         device const uchar* mask [[buffer(10)]],
                         device const float* sinks [[buffer(11)]],
                         device const int* seqs [[buffer(12)]],  // varlen: cu_seqlens_q, cu_seqlens_k
                         uint3 grid_pos [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]]) {
    const int BK = FA_DQ_STAGE(HD, T);
    const int LD = FA_LD(HD, T);
    FA_TG_ARRAY(T, Ks, FA_DQ_STAGE(HD, T) * FA_LD(HD, T));
    FA_TG_ARRAY(T, Vs, FA_DQ_STAGE(HD, T) * FA_LD(HD, T));
    // The pair's partial S and dP: BK / 4 elements of each per lane.
    FA_TG_ARRAY(float, Xs, FA_DQ_SPLIT(HD, sizeof(T)) > 1 ? FA_DQ_STAGE(HD, T) / 2 * FA_THREADS : 1);

    const int DC = FA_DQ_DCHUNK(HD);
    const int SPLIT = FA_DQ_SPLIT(HD, sizeof(T));
    const int ROWS = FA_DQ_ROWS(HD, sizeof(T));
    static_assert(SPLIT == 1 || (SPLIT == FA_S_PARTIALS && SPLIT == FA_DP_PARTIALS && DC == HD),
                  "a split half sums one partial of S and dP over the whole head");
    (void)sinks;  // a sink changes only lse, which the forward gave
    const uint3 pos = fa_group_position(grid_pos, p);
    const int hkv = int(pos.y) / (HD / DC);
    const int c0 = (int(pos.y) % (HD / DC)) * DC;  // this threadgroup's columns of dq
    const int b = int(pos.z);
    const int r0 = int(pos.x) * ROWS;
    const FaLane at = fa_lane(lane);
    const FaSeq seq = fa_sequence(p, seqs, b, fa_is_varlen());
    const int Tq = seq.Tq, Tk = seq.Tk;
    const int cs = c0 + int(sg) % SPLIT * 8;  // the SIMD group's first column

    const FaQueryRow row = fa_query_row(p, Tq, hkv, r0 + int(sg) / SPLIT * 8 + at.row);
    int row_begin = 0x3fffffff, row_end = 0;
    float row_lse = INFINITY, row_delta = 0.0f;
    if (row.valid) {
        row_begin = int(fa_key_begin(row.t, Tq, Tk, p.window_left));
        row_end = int(fa_key_end(row.t, Tq, Tk, p.window_right));
        const fa_long stat = fa_stat_row0(p, seq, b, row.h, fa_is_varlen()) + row.t;
        if (row_begin < row_end) {
            row_lse = fa_row_lse(lse[stat]);
            row_delta = delta[stat];
        }
    }
    int t_lo, t_hi;
    fa_row_span(p, Tq, r0, ROWS, t_lo, t_hi);
    // Varlen: a block past this sequence's rows has nothing to do (a
    // sequence without keys runs on, writing dq = 0).
    if (fa_is_varlen() && t_lo > t_hi) return;
    const int group_begin = int(fa_key_begin(t_lo, Tq, Tk, p.window_left));
    const int group_end = int(fa_key_end(t_hi, Tq, Tk, p.window_right));

    FaRowFragments<HD, FA_DQ_ROWS_IN_REGISTERS(HD, T), T, SPLIT> Q, G;
    Q.load(row.valid ? q + fa_row_offset(p.q.b, p.q.t, p.q.h, b, seq.q0, row.t, row.h, fa_is_varlen()) : nullptr,
           cs - c0 + at.col, p.D, p.scale);
    G.load(row.valid ? dout + fa_row_offset(p.dout.b, p.dout.t, p.dout.h, b, seq.q0, row.t, row.h, fa_is_varlen()) : nullptr,
           cs - c0 + at.col, p.D, 1.0f);

    // Used only with options. A row past the group's heads (row.valid false)
    // takes head 0's: its own slope would be read past the end of the array.
    const FaScoreMods mods =
        fa_score_mods_of(sp, alibi, b, row.valid ? row.h : 0, fa_long(row.t) * sp.mask_i);

    device const T* k_head = k + fa_row_offset(p.k.b, p.k.t, p.k.h, b, seq.k0, 0, hkv, fa_is_varlen());
    device const T* v_head = v + fa_row_offset(p.v.b, p.v.t, p.v.h, b, seq.k0, 0, hkv, fa_is_varlen());
    fa_frag dQ[DC / 8 / SPLIT];
    FA_UNROLL
    for (int d8 = 0; d8 < DC / 8 / SPLIT; ++d8) dQ[d8] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int j0 = group_begin; j0 < group_end; j0 += BK) {
        const int n = min(BK, group_end - j0);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        fa_stage<HD, FA_DQ_STAGE(HD, T), FA_THREADS>(Ks, k_head + fa_long(j0) * p.k.t, p.k.t, n, p.D,
                                                     tid);
        fa_stage<HD, FA_DQ_STAGE(HD, T), FA_THREADS>(Vs, v_head + fa_long(j0) * p.v.t, p.v.t, n, p.D,
                                                     tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // (The halves of a pair hold the same rows: they agree on the
        // tile, and a skipped tile still meets the pair's barrier.)
        const FaTile tile = fa_classify(row_begin, row_end, j0, BK);
        bool active = tile != fa_tile_skip;
        if (SPLIT == 1 && !active) continue;
        if (fa_has_mask() && active &&
            fa_mask_hides_tile<BK>(mods, mask, j0, row_begin, row_end, at.col, sp.mask_j)) {
            if (SPLIT == 1) continue;  // the mask hides this block from the group's rows: no dq from it
            active = false;
        }

        // S = Q K^T and dP = dout V^T, then dS = P (dP - delta), rounded
        // to its operand type (FaPrecision).
        fa_frag S[BK / 8], dP[BK / 8];
        if (SPLIT == 1) {
            fa_rows_times_tile<HD, BK, FA_S_PARTIALS, false>(S, Q, Ks, LD, 1.0f);
        } else {
            if (active) {
                fa_rows_times_tile<HD, BK, 1, false, SPLIT>(S, Q, Ks + cs, LD, 1.0f);
                fa_rows_times_tile<HD, BK, 1, false, SPLIT>(dP, G, Vs + cs, LD, 1.0f);
                fa_pair_put(Xs, S, dP, tid);
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (!active) continue;
            fa_pair_add(Xs, S, dP, tid);
        }
        if (!FaPrecision<T>::scale_q()) fa_scale_scores(S, p.scale);
        // Some row does not see some key of the tile (cut off by the band,
        // or hidden by the mask) and a key of it holds a NaN or an inf: dS
        // K would give that row 0 * inf = NaN, so the tile takes the exact
        // path. A non-finite element of key j makes S[r, j] non-finite for
        // every row r of the tile (q . k with an inf or NaN term), seen or
        // not, so the raw scores tell (fa_nonfinite): no test of K itself.
        const bool exact = (tile == fa_tile_masked || fa_has_mask()) && fa_nonfinite(S);
        if (SPLIT == 1) fa_rows_times_tile<HD, BK, FA_DP_PARTIALS, false>(dP, G, Vs, LD, 1.0f);
        fa_op<typename FaPrecision<T>::dS> dS[BK / 8];
        FA_UNROLL
        for (int k8 = 0; k8 < BK / 8; ++k8) {
            FA_UNROLL
            for (int i = 0; i < 2; ++i) {
                const int j = j0 + k8 * 8 + at.col + i;
                bool seen = tile == fa_tile_full || (j >= row_begin && j < row_end);
                float s = S[k8].thread_elements()[i], dcap = 1.0f;
                if (fa_score_mods != 0 && seen)  // the forward's score options, and softcap's slope
                    s = fa_score_mod(seq, sp, mods, mask, row.t, j, fa_long(j) * sp.mask_j, s,
                                     dcap);
                seen = seen && !(fa_has_mask() && s == -INFINITY);  // the mask hides it
                // dS = 0 where the row does not see the key, by select: dP
                // holds NaN there when V does, and P = 0 would not cancel it
                // (nor would P be 0 there for a row whose lse is NaN).
                dS[k8].thread_elements()[i] = typename FaPrecision<T>::dS(
                    seen ? fa_prob(s, row_lse) * (dP[k8].thread_elements()[i] - row_delta) * dcap
                         : 0.0f);
            }
        }
        // dQ += dS K, on this threadgroup's columns.
        if (exact) {
            fa_masked_accumulate<SPLIT>(dQ, dS, Ks + cs, LD, at, j0, row_begin, row_end,
                                        FaMaskRow{mods, mask, sp.mask_j, fa_has_mask()});
            continue;
        }
        FA_UNROLL
        for (int d8 = 0; d8 < DC / 8 / SPLIT; ++d8) {
            FA_UNROLL
            for (int k8 = 0; k8 < BK / 8; ++k8) {
                fa_op<T> kf;
                simdgroup_load(kf, Ks + k8 * 8 * LD + cs + d8 * 8 * SPLIT, ulong(LD), ulong2(0, 0), false);
                simdgroup_multiply_accumulate(dQ[d8], dS[k8], kf, dQ[d8]);
            }
        }
    }

    if (!row.valid || cs + at.col >= p.D) return;
    fa_store_row<SPLIT>(dq + fa_row_offset(p.dq.b, p.dq.t, p.dq.h, b, seq.q0, row.t, row.h, fa_is_varlen()), dQ, cs, at.col, p.D,
                 p.scale);
}

// dk and dv for FA_DKDV_KEYS(HD) key rows of one kv head, columns [c0, c0 +
// FA_DKDV_DCHUNK(HD)) of D (grid.y = Hkv * HD / FA_DKDV_DCHUNK(HD)), summed
// over the query heads of the group and the query rows that see each key.
// With FA_DKDV_SPLIT = 2 (hd96, hd128) a pair of SIMD groups
// holds 8 keys, each half every other 8-column block of K, V, dK and dV in
// registers; the pair adds its partial S^T and dP^T (fa_pair_put), and
// stores dK and dV through the Q and dO tiles (fa_pair_store_rows).
// Q blocks (scaled by `scale`, as the forward scales Q, so S^T holds the
// forward's scores bit for bit) and dout blocks of FA_DKDV_STAGE(HD, T) rows are
// staged with their lse and delta.
template <int HD, class T>
FA_MAX_THREADS(FA_THREADS) kernel void flash_bwd_dkdv(device const T* q [[buffer(0)]],
                           device const T* k [[buffer(1)]],
                           device const T* v [[buffer(2)]],
                           device const T* dout [[buffer(3)]],
                           device const float* lse [[buffer(4)]],
                           device const float* delta [[buffer(5)]],
                           device T* dk [[buffer(6)]],
                           device T* dv [[buffer(7)]],
                           constant FlashParams& p [[buffer(8)]],
                           constant FlashScoreParams& sp [[buffer(9)]],
                           device const float* alibi [[buffer(10)]],
                           device const uchar* mask [[buffer(11)]],
                           device const float* sinks [[buffer(12)]],
                           device const int* seqs [[buffer(13)]],  // varlen: cu_seqlens_q, cu_seqlens_k
                           uint3 grid_pos [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]]) {
    const int BQ = FA_DKDV_STAGE(HD, T);
    const int LD = FA_LD(HD, T);
    const int DC = FA_DKDV_DCHUNK(HD);
    const int SPLIT = FA_DKDV_SPLIT(HD, sizeof(T));
    static_assert(SPLIT == 1 || (SPLIT == FA_S_PARTIALS && SPLIT == FA_DP_PARTIALS && DC == HD),
                  "a split half sums one partial of S^T and dP^T over the whole head");
    static_assert(SPLIT == 1 || HD / 16 * FA_THREADS <= FA_DKDV_STAGE(HD, T) * FA_LD(HD, T),
                  "the Q and dO tiles hold half the pairs' dK (dV) each (fa_pair_store_rows)");
    (void)sinks;  // a sink changes only lse, which the forward gave
    FA_TG_ARRAY(T, Qs, FA_DKDV_STAGE(HD, T) * FA_LD(HD, T));
    FA_TG_ARRAY(T, Gs, FA_DKDV_STAGE(HD, T) * FA_LD(HD, T));
    FA_TG_ARRAY(float, Ls, FA_DKDV_STAGE(HD, T));
    FA_TG_ARRAY(float, Ds, FA_DKDV_STAGE(HD, T));
    // The pair's partial S^T and dP^T: BQ / 4 elements of each per lane;
    // then a row of each lane's key, j - j_first.
    FA_TG_ARRAY(float, Xs, FA_DKDV_SPLIT(HD, sizeof(T)) > 1 ? (FA_DKDV_STAGE(HD, T) / 2 + 1) * FA_THREADS : 1);

    const uint3 pos = fa_group_position(grid_pos, p);
    const int chunks = HD / DC;
    const int hkv = int(pos.y) / chunks;
    const int c0 = (int(pos.y) % chunks) * DC;
    const int b = int(pos.z);
    const int j_first = int(pos.x) * FA_DKDV_KEYS(HD, sizeof(T));
    const FaLane at = fa_lane(lane);
    const FaSeq seq = fa_sequence(p, seqs, b, fa_is_varlen());
    const int Tq = seq.Tq, Tk = seq.Tk;
    // Varlen: a block past this sequence's keys has nothing to do (a
    // sequence without queries runs on, writing dk = dv = 0).
    if (fa_is_varlen() && j_first >= Tk) return;
    // The SIMD group's first column: its half's first 8-column block.
    const int cs = c0 + int(sg) % SPLIT * 8;

    // This lane's key (shared with lanes ^1, ^8, ^9, and the pair's other
    // half) and the queries seeing it.
    const int j = j_first + int(sg) / SPLIT * 8 + at.row;
    const bool key_valid = j < Tk;
    int col_begin = 0x3fffffff, col_end = 0;
    if (key_valid) {
        col_begin = int(fa_query_begin(j, Tq, Tk, p.window_right));
        col_end = int(fa_query_end(j, Tq, Tk, p.window_left));
    }
    const int j_last = min(j_first + FA_DKDV_KEYS(HD, sizeof(T)), Tk) - 1;
    const int group_begin = int(fa_query_begin(j_first, Tq, Tk, p.window_right));
    const int group_end = int(fa_query_end(j_last, Tq, Tk, p.window_left));

    FaRowFragments<HD, FA_DKDV_ROWS_IN_REGISTERS(HD, T), T, SPLIT> K, V;
    K.load(key_valid ? k + fa_row_offset(p.k.b, p.k.t, p.k.h, b, seq.k0, j, hkv, fa_is_varlen()) : nullptr,
           cs - c0 + at.col, p.D, 1.0f);
    V.load(key_valid ? v + fa_row_offset(p.v.b, p.v.t, p.v.h, b, seq.k0, j, hkv, fa_is_varlen()) : nullptr,
           cs - c0 + at.col, p.D, 1.0f);

    fa_frag dK[DC / 8 / SPLIT], dV[DC / 8 / SPLIT];
    FA_UNROLL
    for (int d8 = 0; d8 < DC / 8 / SPLIT; ++d8) {
        dK[d8] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        dV[d8] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    // One loop over the (query head g of the group, query block i0) pairs,
    // i0 running fastest: what depends on the head is recomputed per step,
    // not hoisted out of an inner loop over i0 and kept live across it
    // (nested, the loops spilled the gate's proxy with K and V resident at
    // 16-bit hd128: a per-lane 64-bit mask offset, kept for the next head).
    // The pairs read their lane's key back from threadgroup memory each
    // step (the score options need it) instead of keeping it live across
    // the loop: float32 hd128, K and V in registers, spilled it on the
    // gate's proxy. Its address is one off the pair exchange's, which the
    // loop holds anyway.
    if (SPLIT > 1) Xs[BQ / 2 * FA_THREADS + tid] = float(j - j_first);
    const bool any_queries = group_begin < group_end;
    for (int g = 0, i0 = group_begin; any_queries && g < p.group;
         i0 = i0 + BQ < group_end ? i0 + BQ : group_begin, g += int(i0 == group_begin)) {
        const int h = hkv * p.group + g;
        const fa_long stat0 = fa_stat_row0(p, seq, b, h, fa_is_varlen());
        device const T* q_head = q + fa_row_offset(p.q.b, p.q.t, p.q.h, b, seq.q0, 0, h, fa_is_varlen());
        device const T* g_head = dout + fa_row_offset(p.dout.b, p.dout.t, p.dout.h, b, seq.q0, 0, h, fa_is_varlen());
        const int n = min(BQ, group_end - i0);
        const int key = SPLIT > 1 ? j_first + int(Xs[BQ / 2 * FA_THREADS + tid]) : j;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        fa_stage<HD, FA_DKDV_STAGE(HD, T), FA_THREADS>(Qs, q_head + fa_long(i0) * p.q.t, p.q.t, n,
                                                       p.D, tid);
        fa_stage<HD, FA_DKDV_STAGE(HD, T), FA_THREADS>(Gs, g_head + fa_long(i0) * p.dout.t,
                                                       p.dout.t, n, p.D, tid);
        for (int r = int(tid); r < BQ; r += FA_THREADS) {
            Ls[r] = r < n ? fa_row_lse(lse[stat0 + i0 + r]) : INFINITY;
            Ds[r] = r < n ? delta[stat0 + i0 + r] : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // (The halves of a pair hold the same keys: they agree on the
        // tile, and a skipped tile still meets the pair's barrier.)
        const FaTile tile = fa_classify(col_begin, col_end, i0, BQ);
        bool active = tile != fa_tile_skip;
        if (SPLIT == 1 && !active) continue;
        // (hd32 has no registers to spare for the score options:
        // plan_backward sends calls with them to the hd64 kernel.)
        const FaScoreMods mods = HD >= 64 ? fa_score_mods_of(sp, alibi, b, h, fa_long(key) * sp.mask_j)
                                          : FaScoreMods{0.0f, 0};
        if (HD >= 64 && fa_has_mask() && active &&
            fa_mask_hides_tile<BQ>(mods, mask, i0, col_begin, col_end, at.col, sp.mask_i)) {
            if (SPLIT == 1) continue;  // the mask hides these queries from the group's keys
            active = false;
        }

        // S^T = K (scale q)^T (float32: the scale multiplies each q
        // element before the product, as the forward's; 16-bit: the
        // product, as the forward's) and dP^T = V dout^T, then P^T and
        // dS^T, rounded to their operand types (FaPrecision). S^T holds
        // the forward's scores bit for bit.
        fa_frag St[BQ / 8], dPt[BQ / 8];
        if (SPLIT == 1) {
            fa_rows_times_tile<HD, BQ, FA_S_PARTIALS, FaPrecision<T>::scale_q()>(St, K, Qs, LD,
                                                                                 p.scale);
            fa_rows_times_tile<HD, BQ, FA_DP_PARTIALS, false>(dPt, V, Gs, LD, 1.0f);
        } else {
            if (active) {
                fa_rows_times_tile<HD, BQ, 1, FaPrecision<T>::scale_q(), SPLIT>(St, K, Qs + cs, LD,
                                                                                p.scale);
                fa_rows_times_tile<HD, BQ, 1, false, SPLIT>(dPt, V, Gs + cs, LD, 1.0f);
                fa_pair_put(Xs, St, dPt, tid);
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (!active) continue;
            fa_pair_add(Xs, St, dPt, tid);
        }
        if (!FaPrecision<T>::scale_q()) fa_scale_scores(St, p.scale);
        // Some query does not see some key of the tile (cut off by the
        // band, or hidden by the mask) and a query of it holds a NaN or
        // an inf in q or dout: P^T dout and dS^T q would give that key
        // 0 * inf = NaN, so the tile takes the exact path. A non-finite
        // element of q_i (of dout_i) makes S^T[j, i] (dP^T[j, i])
        // non-finite for every key j of the tile, so the raw products
        // tell (fa_nonfinite): no test of the staged rows themselves.
        const bool exact = (tile == fa_tile_masked || (HD >= 64 && fa_has_mask())) &&
                           (fa_nonfinite(St) || fa_nonfinite(dPt));
        fa_op<typename FaPrecision<T>::P> Pt[BQ / 8];
        fa_op<typename FaPrecision<T>::dS> dSt[BQ / 8];
        FA_UNROLL
        for (int i8 = 0; i8 < BQ / 8; ++i8) {
            FA_UNROLL
            for (int e = 0; e < 2; ++e) {
                const int ci = i8 * 8 + at.col + e;  // query i0 + ci
                bool seen = tile == fa_tile_full ||
                            (i0 + ci >= col_begin && i0 + ci < col_end);
                float s = St[i8].thread_elements()[e], dcap = 1.0f;
                if (HD >= 64 && fa_score_mods != 0 && seen)
                    s = fa_score_mod(seq, sp, mods, mask, i0 + ci, key,
                                     fa_long(i0 + ci) * sp.mask_i, s, dcap);
                seen = seen && !(HD >= 64 && fa_has_mask() && s == -INFINITY);  // hidden
                // (P = 0 there even for a query whose lse is NaN.)
                const float prob = seen ? fa_prob(s, Ls[ci]) : 0.0f;
                Pt[i8].thread_elements()[e] = typename FaPrecision<T>::P(prob);
                // dS^T = 0 where the query does not see the key, by
                // select: dP^T holds NaN there when dout does.
                dSt[i8].thread_elements()[e] = typename FaPrecision<T>::dS(
                    seen ? prob * (dPt[i8].thread_elements()[e] - Ds[ci]) * dcap : 0.0f);
            }
        }
        // dV += P^T dout and dK += dS^T q (scaled once, as stored), on
        // this threadgroup's columns.
        if (exact) {
            const FaMaskRow hidden{mods, mask, sp.mask_i, HD >= 64 && fa_has_mask()};
            fa_masked_accumulate<SPLIT>(dV, Pt, Gs + cs, LD, at, i0, col_begin, col_end, hidden);
            fa_masked_accumulate<SPLIT>(dK, dSt, Qs + cs, LD, at, i0, col_begin, col_end, hidden);
            continue;
        }
        FA_UNROLL
        for (int d8 = 0; d8 < DC / 8 / SPLIT; ++d8) {
            FA_UNROLL
            for (int i8 = 0; i8 < BQ / 8; ++i8) {
                fa_op<T> gf, qf;
                const int c = cs + d8 * 8 * SPLIT;
                simdgroup_load(gf, Gs + i8 * 8 * LD + c, ulong(LD), ulong2(0, 0), false);
                simdgroup_load(qf, Qs + i8 * 8 * LD + c, ulong(LD), ulong2(0, 0), false);
                simdgroup_multiply_accumulate(dV[d8], Pt[i8], gf, dV[d8]);
                simdgroup_multiply_accumulate(dK[d8], dSt[i8], qf, dK[d8]);
            }
        }
    }

    if (SPLIT > 1) {  // (the halves of a pair hold each row's columns every other 8)
        const int rows = min(FA_DKDV_KEYS(HD, sizeof(T)), Tk - j_first);
        fa_pair_store_rows<HD>(
            dk + fa_row_offset(p.dk.b, p.dk.t, p.dk.h, b, seq.k0, j_first, hkv, fa_is_varlen()), p.dk.t,
            rows, p.D, Qs, Gs, dK, tid, p.scale);
        fa_pair_store_rows<HD>(
            dv + fa_row_offset(p.dv.b, p.dv.t, p.dv.h, b, seq.k0, j_first, hkv, fa_is_varlen()), p.dv.t,
            rows, p.D, Qs, Gs, dV, tid, 1.0f);
        return;
    }
    if (!key_valid || cs + at.col >= p.D) return;
    fa_store_row<SPLIT>(dk + fa_row_offset(p.dk.b, p.dk.t, p.dk.h, b, seq.k0, j, hkv, fa_is_varlen()), dK, cs,
                        at.col, p.D, p.scale);
    fa_store_row<SPLIT>(dv + fa_row_offset(p.dv.b, p.dv.t, p.dv.h, b, seq.k0, j, hkv, fa_is_varlen()), dV, cs,
                        at.col, p.D, 1.0f);
}

#define FA_INSTANTIATE_BWD(NAME, T, HD)                                                         \
    template FA_HOST_NAME("flash_bwd_dq_" #NAME "_hd" #HD) kernel void flash_bwd_dq<HD, T>(    \
        device const T*, device const T*, device const T*, device const T*, device const float*, \
        device const float*, device T*, constant FlashParams&, constant FlashScoreParams&,       \
        device const float*, device const uchar*, device const float*, device const int*, uint3, \
        uint, uint, uint);                                                                       \
    template FA_HOST_NAME("flash_bwd_dkdv_" #NAME "_hd" #HD) kernel void flash_bwd_dkdv<HD, T>( \
        device const T*, device const T*, device const T*, device const T*, device const float*, \
        device const float*, device T*, device T*, constant FlashParams&,                        \
        constant FlashScoreParams&, device const float*, device const uchar*,                    \
        device const float*, device const int*, uint3, uint, uint, uint);
#define FA_INSTANTIATE_BWD_TYPES(HD) FA_STORAGE_TYPES(FA_INSTANTIATE_BWD, HD)
FA_HEAD_BUCKETS(FA_INSTANTIATE_BWD_TYPES)

#define FA_INSTANTIATE_PREPROCESS(NAME, T, UNUSED)                                                \
    template FA_HOST_NAME("flash_bwd_preprocess_" #NAME) kernel void flash_bwd_preprocess<T>(   \
        device const T*, device const T*, device float*, constant FlashParams&, device const int*, \
        uint3, uint);
FA_STORAGE_TYPES(FA_INSTANTIATE_PREPROCESS, 0)
