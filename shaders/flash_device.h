// What the tiled kernels share: the function constants, a lane's place in
// an 8x8 simdgroup_matrix, the row numbering of a threadgroup, staging of a
// tile into threadgroup memory, the row fragments of a SIMD group, and the
// visibility classification of a tile. Kernel code only (it uses Metal's
// vector types and address spaces): C++ host code never includes it.
#pragma once

#include "flash_kernels.h"

using namespace metal;

FA_FUNCTION_CONSTANT(bool, fa_head_full, FA_FC_HEAD_FULL)
FA_FUNCTION_CONSTANT(bool, fa_head_vec16, FA_FC_HEAD_VEC16)
FA_FUNCTION_CONSTANT(int, fa_score_mods, FA_FC_SCORE_MODS)
FA_FUNCTION_CONSTANT(bool, fa_varlen, FA_FC_VARLEN)
// Whether the pipeline runs a variable-length batch (below).
FA_INLINE bool fa_is_varlen() { return fa_varlen; }

// The sequence a threadgroup works on. A dense call: batch b, the call's Tq
// and Tk. A variable-length batch in one launch (FlashParams::varlen_seqs
// > 0, core/varlen.h; FlashAttention-2's varlen kernels): grid.z is the
// sequence b, whose rows the kernel reads from the int32 table `seqs` --
// cu_seqlens_q (varlen_seqs + 1 entries) then cu_seqlens_k -- the packed
// arrays' rows [q0, q0 + Tq) and [k0, k0 + Tk); the grid covers the longest
// sequence and a tile past this one's length exits at once. Uniform over
// the threadgroup (scalar registers), read once in the prologue.
struct FaSeq {
    int Tq, Tk;
    fa_long q0, k0;
};
FA_INLINE FaSeq fa_sequence(constant FlashParams& p, device const int* seqs, int b, bool varlen) {
    FaSeq s;
    s.Tq = p.Tq;
    s.Tk = p.Tk;
    s.q0 = 0;
    s.k0 = 0;
    if (varlen) {
        const int q0 = seqs[b], k0 = seqs[p.B + 1 + b];
        s.Tq = seqs[b + 1] - q0;
        s.Tk = seqs[p.B + 2 + b] - k0;
        s.q0 = q0;
        s.k0 = k0;
    }
    return s;
}
// Element offset of row t, head h of the sequence in an array of strides
// (sb, st, sh): batch b's rows (dense), or the packed rows from row0 (varlen: q0 or k0).
FA_INLINE fa_long fa_row_offset(fa_long sb, fa_long st, fa_long sh, int b, fa_long row0, fa_long t,
                                fa_long h, bool varlen) {
    return varlen ? (row0 + t) * st + h * sh : fa_offset(sb, st, sh, b, t, h);
}
// Where head h's rows of the sequence start in lse and delta: (B, H, Tq)
// dense; varlen, sequence b's (H, Tq_b) block at H * q0 (core/engine.h's Varlen).
FA_INLINE fa_long fa_stat_row0(constant FlashParams& p, FaSeq s, int b, int h, bool varlen) {
    return (varlen ? fa_long(p.H) * s.q0 : fa_long(b) * p.H * s.Tq) + fa_long(h) * s.Tq;
}

// Split-KV decode (FlashParams::kv_splits > 1): chunk `split` of a
// sequence's Tk keys is [split * chunk, (split + 1) * chunk); a range
// [begin, end) of keys is cut to it.
FA_INLINE void fa_split_keys(constant FlashParams& p, int Tk, int split, thread int& begin,
                             thread int& end) {
    const int chunk = (Tk + p.kv_splits - 1) / p.kv_splits;
    begin = max(begin, split * chunk);
    end = min(end, (split + 1) * chunk);
}
// Where chunk `split`'s partial result for query row t of head h, batch b
// lies in the float32 scratch the forward kernels write and
// flash_fwd_merge reads: partial_o (splits, B, Tq, H, D), partial_lse
// (splits, B, H, Tq).
FA_INLINE fa_long fa_partial_o_at(constant FlashParams& p, int split, int b, int t, int h) {
    return (fa_long(split) * p.B * p.Tq * p.H + (fa_long(b) * p.Tq + t) * p.H + h) * p.D;
}
FA_INLINE fa_long fa_partial_lse_at(constant FlashParams& p, int split, int b, int t, int h) {
    return fa_long(split) * p.B * p.H * p.Tq + (fa_long(b) * p.H + h) * p.Tq + t;
}

// The storage type T of q, k, v, o, do and the gradients (issue 15): float,
// half or bfloat (MSL 3.1), a template parameter of every tiled kernel.
// Staged tiles hold T as it is in memory. The products take their operands
// in T (fa_op<T>: simdgroup_half8x8, simdgroup_bfloat8x8 or float8x8) and
// accumulate in float32 (fa_frag), as llama.cpp's kernel_mul_mm and MFA
// multiply 16-bit matrices into float ones; scores, softmax statistics and
// every accumulator are float32; results are rounded to T once, when
// written.
typedef simdgroup_matrix<float, 8, 8> fa_frag;
template <class T>
using fa_op = simdgroup_matrix<T, 8, 8>;

// Where each storage type rounds (FaPrecision<T>):
//  - scale_q: float32 scores are (scale q) . k, q scaled as it is loaded
//    (README: they stay finite up to D |scale q| |k| < 3.4e38); a 16-bit
//    q is multiplied unscaled, its products with k exact in float32, and
//    the score is scale (q . k): scaling q first would round it to 16 bits;
//  - P, the operand of P V and P^T dO: the probabilities rounded to T
//    (as MFA rounds them to half), in [0, 1];
//  - dS, the operand of dS K and dS^T q: bfloat for bfloat16 inputs (as
//    MFA on Apple9), float32 for float16 inputs, whose range a gradient
//    can exceed (65504), and for float32.
template <class T>
struct FaPrecision {
    static constexpr bool scale_q() { return false; }
    typedef T P;
    typedef T dS;
};
template <>
struct FaPrecision<float> {
    static constexpr bool scale_q() { return true; }
    typedef float P;
    typedef float dS;
};
template <>
struct FaPrecision<half> {
    static constexpr bool scale_q() { return false; }
    typedef half P;
    typedef float dS;
};

// The threadgroup's position in the whole launch: its position in the
// dispatched piece plus the piece's origin (FlashParams::group_offset_*).
FA_INLINE uint3 fa_group_position(uint3 grid_pos, constant FlashParams& p) {
    return uint3(grid_pos.x + uint(p.group_offset_x), grid_pos.y + uint(p.group_offset_y),
                 grid_pos.z + uint(p.group_offset_z));
}

// The lane's two elements of an 8x8 fragment: (row, col) and (row, col + 1)
// (Apple's layout, as MLX's steel mma.h get_coord spells it).
struct FaLane {
    int row, col;
};
FA_INLINE FaLane fa_lane(uint lane) {
    const int q = int(lane) / 4;
    FaLane at;
    at.row = (q & 4) + (int(lane) / 2) % 4;
    at.col = (q & 2) * 2 + (int(lane) % 2) * 2;
    return at;
}

// The lanes that share a row of a fragment are lane ^ 1, ^ 8 and ^ 9: a row
// reduction is two shuffles.
FA_INLINE float fa_row_max(float x) {
    x = max(x, simd_shuffle_xor(x, ushort(1)));
    return max(x, simd_shuffle_xor(x, ushort(8)));
}
FA_INLINE float fa_row_sum(float x) {
    x += simd_shuffle_xor(x, ushort(1));
    return x + simd_shuffle_xor(x, ushort(8));
}

// A query row of the packed numbering (FlashParams::rows_per_head): row r
// of kv head hkv is query head hkv * group + r / rows_per_head, position
// r % rows_per_head, valid when that is < Tq.
struct FaQueryRow {
    int h, t;
    bool valid;
};
FA_INLINE FaQueryRow fa_query_row(constant FlashParams& p, int Tq, int hkv, int r) {
    FaQueryRow q;
    const int g = r / p.rows_per_head;
    q.t = r - g * p.rows_per_head;
    q.h = hkv * p.group + g;
    q.valid = g < p.group && q.t < Tq;
    return q;
}

// The positions t that rows [r0, r0 + n) of the packed numbering cover,
// as a range [lo, hi] (conservative when the rows span two heads).
FA_INLINE void fa_row_span(constant FlashParams& p, int Tq, int r0, int n, thread int& lo,
                            thread int& hi) {
    const int g0 = r0 / p.rows_per_head, g1 = (r0 + n - 1) / p.rows_per_head;
    const int t0 = r0 - g0 * p.rows_per_head, t1 = r0 + n - 1 - g1 * p.rows_per_head;
    lo = g0 == g1 ? t0 : 0;
    hi = min(g0 == g1 ? t1 : p.rows_per_head - 1, Tq - 1);
}

// Two adjacent elements of a row, zero past column n: a fragment's lane
// elements loaded straight from device memory.
template <class T>
FA_INLINE vec<T, 2> fa_load_pair(device const T* row, int c, int n) {
    if (fa_head_full || c + 1 < n) return vec<T, 2>(row[c], row[c + 1]);
    return vec<T, 2>(c < n ? row[c] : T(0.0f), T(0.0f));
}

// Writes the lane's elements of a row of N8 fragments (columns c0 + 8 *
// STEP * n8 + col and the next: STEP 2 for a dK/dV half, FA_DKDV_SPLIT)
// times `scale` to `out`, rounded to T, skipping columns at or past D.
template <int STEP = 1, int N8, class T>
FA_INLINE void fa_store_row(device T* out, const thread fa_frag (&A)[N8], int c0, int col, int D,
                            float scale) {
    FA_UNROLL
    for (int n8 = 0; n8 < N8; ++n8) {
        const int c = c0 + n8 * 8 * STEP + col;
        if (fa_head_full || c < D) out[c] = T(A[n8].thread_elements()[0] * scale);
        if (fa_head_full || c + 1 < D) out[c + 1] = T(A[n8].thread_elements()[1] * scale);
    }
}

// 16 bytes of T, aligned as T: the unit one thread moves per staging step
// (MLX's BlockLoaderT reads its tiles so). Any row start will do.
template <class T>
struct FaVec16 {
    T e[FA_VEC16(T)];
};

// dst[0, V) = src[0, V) (V = FA_VEC16(T)): one 16-byte load and store on the
// GPU. The C++ side (metal-sim, the gate's proxy) copies the elements: the
// same bytes, without reading an array as a struct.
template <class T>
FA_ALWAYS_INLINE void fa_copy16(threadgroup T* dst, device const T* src) {
#ifdef __METAL_VERSION__
    *reinterpret_cast<threadgroup FaVec16<T>*>(dst) = *reinterpret_cast<device const FaVec16<T>*>(src);
#else
    for (int i = 0; i < FA_VEC16(T); ++i) dst[i] = src[i];
#endif
}
// The 16 bytes at src, as one load on the GPU (aligned as T: any element
// will do).
template <class T>
FA_ALWAYS_INLINE FaVec16<T> fa_load16(device const T* src) {
#ifdef __METAL_VERSION__
    return *reinterpret_cast<device const FaVec16<T>*>(src);
#else
    FaVec16<T> x;
    for (int i = 0; i < FA_VEC16(T); ++i) x.e[i] = src[i];
    return x;
#endif
}
template <class T>
FA_ALWAYS_INLINE void fa_zero16(threadgroup T* dst) {
#ifdef __METAL_VERSION__
    *reinterpret_cast<threadgroup FaVec16<T>*>(dst) = FaVec16<T>{};
#else
    for (int i = 0; i < FA_VEC16(T); ++i) dst[i] = T(0.0f);
#endif
}

// Copies `rows` rows of a block (row r at src + r * pitch, its first D
// elements) into a staged tile of STAGE rows of pitch FA_LD(HD, T), as they
// are: 16 bytes at a time, no conversion, no scaling, no test of the values
// (a NaN or inf is found where it matters: fa_leaked, fa_nonfinite). Columns [D, HD) and
// rows past `rows` are written zero, so padding adds nothing to a product.
// THREADS threads (the whole group) take part, each moving at most
// ceil(vectors / THREADS) of them, one after another: the loop is not
// unrolled, so a thread has one vector in flight and the staging costs the
// tile loop 4 registers, not 4 per vector (unrolled, the gate's proxy
// issued every load first and spilled the resident fragments).
template <int HD, int STAGE, int THREADS, class T>
FA_INLINE void fa_stage(threadgroup T* tile, device const T* src, fa_long pitch, int rows, int D,
                        uint tid) {
    const int V = FA_VEC16(T);
    const int per_row = HD / V;
    const int vectors = STAGE * per_row;
    FA_NO_UNROLL
    for (int i = 0; i < (vectors + THREADS - 1) / THREADS; ++i) {
        const int e = i * THREADS + int(tid);
        if (vectors % THREADS != 0 && e >= vectors) break;
        const int r = e / per_row;
        const int c = (e - r * per_row) * V;
        threadgroup T* dst = tile + r * FA_LD(HD, T) + c;
        device const T* row = src + fa_long(r) * pitch + c;
        if (r < rows && (fa_head_vec16 || c + V <= D)) {
            if (fa_head_full || c < D) fa_copy16(dst, row);
            else fa_zero16(dst);
        } else if (r >= rows || c >= D) {
            fa_zero16(dst);
        } else {  // the vector holding column D - 1 when D is not a multiple of V
            for (int k = 0; k < V; ++k) dst[k] = c + k < D ? row[k] : T(0.0f);
        }
    }
}

// Whether the SIMD group's accumulators (N8 fragments) hold a NaN or an inf
// in a valid row (`mine`): after a tile whose rows do not all see all its
// columns, a NaN or inf in the operand multiplied may have reached a row
// through a masked zero (0 * inf = NaN). The forward then runs its tile
// loop again, taking the exact path (fa_masked_accumulate) for such tiles
// (the backward decides per tile instead: fa_nonfinite);
// a NaN that belongs there (a row that sees it) also asks for that pass,
// which gives the same answer. Uniform across the SIMD group.
template <int N8>
FA_INLINE bool fa_leaked(const thread fa_frag (&acc)[N8], bool mine) {
    bool bad = false;
    FA_UNROLL
    for (int n8 = 0; n8 < N8; ++n8)
        bad = bad || !isfinite(acc[n8].thread_elements()[0]) || !isfinite(acc[n8].thread_elements()[1]);
    return simd_max(int(bad && mine)) != 0;
}

// Whether any of the SIMD group's N8 fragments (raw products, before any
// masking) holds a NaN or an inf: uniform across the SIMD group, so the
// tile's path (matrix products or fa_masked_accumulate) is too. The
// backward asks it of the scores and dP of a tile some row does not fully
// see (a per-tile select, no second pass).
template <int N8>
FA_INLINE bool fa_nonfinite(const thread fa_frag (&x)[N8]) {
    bool bad = false;
    FA_UNROLL
    for (int n8 = 0; n8 < N8; ++n8)
        bad = bad || !isfinite(x[n8].thread_elements()[0]) || !isfinite(x[n8].thread_elements()[1]);
    return simd_max(int(bad)) != 0;
}

// The lane holding element (row, col) of a fragment, col even (the inverse
// of fa_lane: lane bits 4, 2, 1 are the row's, bits 3 and 0 the column's).
FA_INLINE ushort fa_lane_of(int row, int col) {
    return ushort(((row >> 2) << 4) | ((col >> 2) << 3) | (((row >> 1) & 1) << 2) |
                  ((row & 1) << 1) | ((col >> 1) & 1));
}

// The 8 x HD rows of one operand that a SIMD group multiplies by, as
// fragments of T (frag(d8) is columns 8*d8 .. 8*d8+7, counted from the
// `col` given to load; with STEP > 1 only every STEP-th 8-column block is
// held, frag(e) being block STEP*e: a dK/dV half, FA_DKDV_SPLIT); float rows times
// `scale` (FaPrecision::scale_q; the others' products are scaled). With IN_REGISTERS they
// are loaded once and live in registers (HD/4 per thread as float, HD/8 as
// 16-bit pairs); otherwise each frag() loads the lane's two elements again
// from device memory. Rows the SIMD group does not own (row == 0) are zero.
template <int HD, bool IN_REGISTERS, class T, int STEP = 1>
struct FaRowFragments;

template <class T>
FA_ALWAYS_INLINE fa_op<T> fa_row_frag(device const T* row, int c, int D, float scale) {
    fa_op<T> m;
    const vec<T, 2> x = row ? fa_load_pair(row, c, D) : vec<T, 2>(T(0.0f), T(0.0f));
    if (FaPrecision<T>::scale_q()) {
        m.thread_elements()[0] = T(float(x[0]) * scale);
        m.thread_elements()[1] = T(float(x[1]) * scale);
    } else {
        m.thread_elements()[0] = x[0];
        m.thread_elements()[1] = x[1];
    }
    return m;
}

template <int HD, class T, int STEP>
struct FaRowFragments<HD, true, T, STEP> {
    fa_op<T> f[HD / 8 / STEP];

    FA_INLINE void load(device const T* row, int col, int D, float scale) {
        FA_UNROLL
        for (int d8 = 0; d8 < HD / 8 / STEP; ++d8) f[d8] = fa_row_frag(row, d8 * 8 * STEP + col, D, scale);
    }
    FA_INLINE fa_op<T> frag(int d8) const { return f[d8]; }
};

template <int HD, class T, int STEP>
struct FaRowFragments<HD, false, T, STEP> {
    device const T* row_;
    int col_, D_;
    float scale_;

    FA_INLINE void load(device const T* row, int col, int D, float scale) {
        row_ = row, col_ = col, D_ = D, scale_ = scale;
    }
    FA_INLINE fa_op<T> frag(int d8) const { return fa_row_frag(row_, d8 * 8 * STEP + col_, D_, scale_); }
};

// C = A B^T for the SIMD group's 8 rows (A's fragments, of T) against the
// BK staged rows of `tile` (B, pitch ld): C[k8] is the 8 x 8 block of
// columns 8*k8 .. 8*k8+7, B^T's fragment (d8, k8) the transposed load of
// the tile. The sum over D runs in PARTS interleaved partial sums (d8 %
// PARTS) added at the end, each a float32 chain of HD / PARTS terms.
// Scores take FA_S_PARTIALS, so a score's rounding error stays within the
// accuracy rule at score spreads up to 100 (README, accuracy); the forward,
// dQ and dK/dV kernels all sum S so, and the backward's scores are the
// forward's, bit for bit. dP = dO V^T takes FA_DP_PARTIALS, as delta =
// rowsum(dO o) sums (a saturated row's dP - delta is then exactly 0).
// SCALE_B: B's fragments (float32 q, when A is K) are multiplied by b_scale
// as they load, as the forward scales q. STEP > 1: A holds every STEP-th
// block of D (FaRowFragments' STEP; `tile` starts at the first one's
// column), and C gets that share of the sum (a dK/dV half: PARTS 1, its
// partial sum, FA_DKDV_SPLIT).
template <int HD, int BK, int PARTS, bool SCALE_B, int STEP = 1, class Rows, class T>
FA_ALWAYS_INLINE void fa_rows_times_tile(thread fa_frag (&C)[BK / 8], const thread Rows& A,
                                  threadgroup const T* tile, int ld, float b_scale) {
    FA_UNROLL
    for (int k8 = 0; k8 < BK / 8; ++k8) {
        fa_frag part[PARTS];
        FA_UNROLL
        for (int s = 0; s < PARTS; ++s) part[s] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        FA_UNROLL
        for (int d8 = 0; d8 < HD / 8 / STEP; ++d8) {
            fa_op<T> bt;
            simdgroup_load(bt, tile + k8 * 8 * ld + d8 * 8 * STEP, ulong(ld), ulong2(0, 0), true);
            if (SCALE_B) {  // float32 only (FaPrecision::scale_q)
                bt.thread_elements()[0] = T(float(bt.thread_elements()[0]) * b_scale);
                bt.thread_elements()[1] = T(float(bt.thread_elements()[1]) * b_scale);
            }
            simdgroup_multiply_accumulate(part[d8 % PARTS], A.frag(d8), bt, part[d8 % PARTS]);
        }
        FA_UNROLL
        for (int i = 0; i < 2; ++i) {
            float sum = part[0].thread_elements()[i];
            FA_UNROLL
            for (int s = 1; s < PARTS; ++s) sum += part[s].thread_elements()[i];
            C[k8].thread_elements()[i] = sum;
        }
    }
}

// The lane's scores times the scale (16-bit q: FaPrecision::scale_q).
template <int N8>
FA_ALWAYS_INLINE void fa_scale_scores(thread fa_frag (&S)[N8], float scale) {
    FA_UNROLL
    for (int n8 = 0; n8 < N8; ++n8) {
        S[n8].thread_elements()[0] *= scale;
        S[n8].thread_elements()[1] *= scale;
    }
}

// How a SIMD group meets one tile of (its 8 rows) x (a block of columns):
// not at all, every element visible, or element by element. Decided from
// each lane's row range [begin, end) of visible columns, made uniform
// across the SIMD group (the matrix operations need all 32 lanes).
enum FaTile { fa_tile_skip, fa_tile_full, fa_tile_masked };

FA_INLINE FaTile fa_classify(int begin, int end, int c0, int width) {
    const int lo = simd_min(begin), hi = simd_max(end);
    const int lo_end = simd_min(end), hi_begin = simd_max(begin);
    if (c0 >= hi || c0 + width <= lo || lo >= hi) return fa_tile_skip;
    if (c0 >= hi_begin && c0 + width <= lo_end) return fa_tile_full;
    return fa_tile_masked;
}

// tanh to a few ulps from exp2 alone (no stdlib tanh is assumed): near 0
// Eigen's rational fit, where 1 - 2 / (e^2x + 1) would cancel; beyond, that
// form, which saturates to +-1 (e^2x = inf gives 1). NaN stays NaN.
FA_INLINE float fa_tanh(float x) {
    const float ax = abs(x);
    float t;
    if (ax < 0.625f) {
        const float x2 = ax * ax;
        float num = fma(x2, -2.76076847742355e-16f, 2.00018790482477e-13f);
        num = fma(x2, num, -8.60467152213735e-11f);
        num = fma(x2, num, 5.12229709037114e-08f);
        num = fma(x2, num, 1.48572235717979e-05f);
        num = fma(x2, num, 6.37261928875436e-04f);
        num = fma(x2, num, 4.89352455891786e-03f);
        float den = fma(x2, 1.19825839466702e-06f, 1.18534705686654e-04f);
        den = fma(x2, den, 2.26843463243900e-03f);
        den = fma(x2, den, 4.89352518554385e-03f);
        t = ax * num / den;
    } else {
        t = 1.0f - 2.0f / (exp2(ax * (2.0f * M_LOG2E_F)) + 1.0f);  // NaN: ax < 0.625 fails
    }
    return x < 0.0f ? -t : t;
}

// The score options of a call (the function constant fa_score_mods, which
// is FlashParams::score_mods; issue 16) for one (batch, head) and one fixed
// query row or key: what every score of the loop needs, computed once
// before it. A pipeline for plain attention has none of this code.
struct FaScoreMods {
    float slope;        // ALiBi's, of this head
    fa_long mask_base;  // the mask offset of (b, h) and the fixed row or key
};
FA_INLINE FaScoreMods fa_score_mods_of(constant FlashScoreParams& sp, device const float* alibi,
                                       int b, int h, fa_long fixed_offset) {
    FaScoreMods m;
    m.slope = (fa_score_mods & FA_SCORE_ALIBI) ? alibi[b * sp.alibi_b + h] : 0.0f;
    m.mask_base = fa_long(b) * sp.mask_b + fa_long(h) * sp.mask_h + fixed_offset;
    return m;
}

// Whether the call's mask hides the score at offset `at` past mods.mask_base:
// a false entry of a bool mask, a -inf of a float mask (NaN does not hide).
// A hidden key never reaches the row, whatever its k and v hold (the
// README's NaN and inf rule): false without a mask.
FA_INLINE bool fa_mask_hides(FaScoreMods mods, device const uchar* mask, fa_long at) {
    if (fa_score_mods & FA_SCORE_MASK_BOOL) return mask[mods.mask_base + at] == 0;
    if (fa_score_mods & FA_SCORE_MASK_FLOAT)
        return reinterpret_cast<device const float*>(mask)[mods.mask_base + at] == -INFINITY;
    return false;
}
FA_INLINE bool fa_has_mask() {
    return (fa_score_mods & (FA_SCORE_MASK_BOOL | FA_SCORE_MASK_FLOAT)) != 0;
}

// The mask as the exact path reads it along a lane's row of a tile: column
// c of the row is entry mods.mask_base + c * stride; `on` false (no mask,
// or a kernel that takes no options) hides nothing.
struct FaMaskRow {
    FaScoreMods mods;
    device const uchar* mask;
    fa_long stride;
    bool on;
};
FA_INLINE bool fa_mask_row_hides(FaMaskRow m, int c) {
    return m.on && fa_mask_hides(m.mods, m.mask, fa_long(c) * m.stride);
}

// True when the mask hides every score of a SIMD group's tile from the
// rows (or keys) its lanes hold, so the tile is skipped as the cpu engine
// skips it: each lane checks the columns c0 + [0, WIDTH) it meets
// (col, col + 1 of each 8-column fragment) that its band [begin, end) lets
// it see, at mask offset mods.mask_base + c * stride.
template <int WIDTH>
FA_INLINE bool fa_mask_hides_tile(FaScoreMods mods, device const uchar* mask, int c0, int begin,
                                  int end, int col, fa_long stride) {
    int visible = 0;
    FA_UNROLL
    for (int c8 = 0; c8 < WIDTH / 8; ++c8) {
        FA_UNROLL
        for (int i = 0; i < 2; ++i) {
            const int c = c0 + c8 * 8 + col + i;
            if (c < begin || c >= end) continue;
            visible |= int(!fa_mask_hides(mods, mask, fa_long(c) * stride));
        }
    }
    return simd_max(visible) == 0;
}

// acc += A B over only the columns k of A (k_first + k as a key or query)
// that the lane's row sees: in its band [begin, end) and not hidden by the
// mask (`hidden`). The exact path for a tile whose B holds a NaN or an inf
// where some row does not see some column: a matrix multiply would give that
// row 0 * inf = NaN. A is K8 fragments of 8 x 8 (an element at a time,
// gathered by shuffles), acc N8 fragments of output columns, B the staged
// rows k at pitch ld from the output's first column (acc[n8] is B's
// columns 8 * STEP * n8 on: STEP 2 for a dK/dV half). Slow, and only taken
// for such tiles.
template <int STEP = 1, int K8, int N8, class TA, class T>
FA_INLINE void fa_masked_accumulate(thread fa_frag (&acc)[N8], const thread fa_op<TA> (&A)[K8],
                                    threadgroup const T* B, int ld, FaLane at, int k_first,
                                    int begin, int end, FaMaskRow hidden) {
    for (int k = 0; k < K8 * 8; ++k) {
        // Every lane shuffles (uniform control flow); the value is the
        // lane's row's element k of A.
        // (no run-time index into a fragment: that would put it in memory)
        const ushort src = fa_lane_of(at.row, k & 6);
        float a = 0.0f;
        FA_UNROLL
        for (int k8 = 0; k8 < K8; ++k8) {
            const float x0 = simd_shuffle(float(A[k8].thread_elements()[0]), src);
            const float x1 = simd_shuffle(float(A[k8].thread_elements()[1]), src);
            if (k8 == k / 8) a = (k & 1) ? x1 : x0;
        }
        if (k_first + k < begin || k_first + k >= end) continue;
        if (fa_mask_row_hides(hidden, k_first + k)) continue;
        threadgroup const T* b = B + k * ld + at.col;
        FA_UNROLL
        for (int n8 = 0; n8 < N8; ++n8) {
            acc[n8].thread_elements()[0] =
                fma(a, float(b[n8 * 8 * STEP]), acc[n8].thread_elements()[0]);
            acc[n8].thread_elements()[1] =
                fma(a, float(b[n8 * 8 * STEP + 1]), acc[n8].thread_elements()[1]);
        }
    }
}

// The options on the score s of query row t and key j, which the band lets
// it see: softcap, then ALiBi, then the mask (-inf hides the key);
// mask_offset is the element's offset past mods.mask_base. dcap gets
// d(softcap)/ds (1 without a softcap).
FA_INLINE float fa_score_mod(FaSeq seq, constant FlashScoreParams& sp,
                             FaScoreMods mods, device const uchar* mask, int t, int j,
                             fa_long mask_offset, float s, thread float& dcap) {
    dcap = 1.0f;
    if (fa_score_mods & FA_SCORE_SOFTCAP) {
        const float th = fa_tanh(s / sp.softcap);
        s = sp.softcap * th;
        dcap = fma(-th, th, 1.0f);
    }
    if (fa_score_mods & FA_SCORE_ALIBI) s = fma(-mods.slope, abs(float(t + seq.Tk - seq.Tq - j)), s);
    if (fa_has_mask()) {
        if (fa_mask_hides(mods, mask, mask_offset))
            s = -INFINITY;  // whatever s was: a NaN or +inf score of a hidden key too
        else if (fa_score_mods & FA_SCORE_MASK_FLOAT)
            s += reinterpret_cast<device const float*>(mask)[mods.mask_base + mask_offset];
    }
    return s;
}
