// What the tiled kernels share: the function constants, a lane's place in
// an 8x8 simdgroup_matrix, the row numbering of a threadgroup, staging of a
// tile into threadgroup memory, the row fragments of a SIMD group, and the
// visibility classification of a tile. Kernel code only (it uses Metal's
// vector types and address spaces): C++ host code never includes it.
#pragma once

#include "flash_kernels.h"

using namespace metal;

FA_FUNCTION_CONSTANT(bool, fa_head_full, FA_FC_HEAD_FULL)
FA_FUNCTION_CONSTANT(bool, fa_head_vec4, FA_FC_HEAD_VEC4)
FA_FUNCTION_CONSTANT(int, fa_score_mods, FA_FC_SCORE_MODS)

typedef simdgroup_matrix<float, 8, 8> fa_frag;

// The storage type T of q, k, v, o, do and the gradients (issue 15): float,
// half or bfloat (MSL 3.1), a template parameter of every tiled kernel.
// Staged tiles hold T; fragments, scores, softmax statistics and every
// accumulator are float32; results are rounded to T once, when written.
// A tile that must be scaled (the dK/dV kernel's q) takes the scale at
// staging only when T is float (x * scale is then exactly the float the
// fragment holds); a 16-bit tile keeps x and its fragment loads multiply,
// since rounding x * scale to 16 bits would change the scores the backward
// must recompute bit for bit.
template <class T>
struct FaStorage {
    static FA_INLINE bool scaled_in_tile() { return false; }
};
template <>
struct FaStorage<float> {
    static FA_INLINE bool scaled_in_tile() { return true; }
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
FA_INLINE FaQueryRow fa_query_row(constant FlashParams& p, int hkv, int r) {
    FaQueryRow q;
    const int g = r / p.rows_per_head;
    q.t = r - g * p.rows_per_head;
    q.h = hkv * p.group + g;
    q.valid = g < p.group && q.t < p.Tq;
    return q;
}

// The positions t that rows [r0, r0 + n) of the packed numbering cover,
// as a range [lo, hi] (conservative when the rows span two heads).
FA_INLINE void fa_row_span(constant FlashParams& p, int r0, int n, thread int& lo, thread int& hi) {
    const int g0 = r0 / p.rows_per_head, g1 = (r0 + n - 1) / p.rows_per_head;
    const int t0 = r0 - g0 * p.rows_per_head, t1 = r0 + n - 1 - g1 * p.rows_per_head;
    lo = g0 == g1 ? t0 : 0;
    hi = min(g0 == g1 ? t1 : p.rows_per_head - 1, p.Tq - 1);
}

// Two adjacent elements of a row as floats, zero past column n: a
// fragment's lane elements loaded straight from device memory.
template <class T>
FA_INLINE float2 fa_load_pair(device const T* row, int c, int n) {
    if (fa_head_full || c + 1 < n) return float2(float(row[c]), float(row[c + 1]));
    return float2(c < n ? float(row[c]) : 0.0f, 0.0f);
}

// Four consecutive elements as floats, by one vector load where MSL has
// the packed type (packed_float4, packed_half4 need only the elements' own
// alignment); bfloat, which has no packed vector in MSL 3.1, element by
// element. The C++ side reads them one by one: the same values, without
// reinterpreting an array as vectors.
FA_INLINE float4 fa_load4(device const float* p) {
#ifdef __METAL_VERSION__
    return float4(*reinterpret_cast<device const packed_float4*>(p));
#else
    return float4(p[0], p[1], p[2], p[3]);
#endif
}
FA_INLINE float4 fa_load4(device const half* p) {
#ifdef __METAL_VERSION__
    return float4(half4(*reinterpret_cast<device const packed_half4*>(p)));
#else
    return float4(float(p[0]), float(p[1]), float(p[2]), float(p[3]));
#endif
}
FA_INLINE float4 fa_load4(device const bfloat* p) {
    return float4(float(p[0]), float(p[1]), float(p[2]), float(p[3]));
}

// A fragment of a staged tile: element (r, c) is src[r * ld + c], or with
// `transpose` src[c * ld + r], as float. A float tile is one simdgroup_load;
// a 16-bit tile is read by each lane at its two elements (Apple's layout,
// as fa_lane) and widened, as MLX's steel kernels load theirs: MSL's
// simdgroup_load moves no type into another, and needs no bfloat matrices.
// The lane's place is recomputed from `lane` (as simdgroup_load does), not
// taken from a FaLane kept live: on the gate's proxies that keeps the dQ
// and dK/dV kernels' registers as the float32 ones (hd64: 128 + spills
// otherwise, 117 / 127 so).
FA_ALWAYS_INLINE void fa_load_tile(thread fa_frag& f, threadgroup const float* src, int ld,
                                   bool transpose, uint lane) {
    (void)lane;
    simdgroup_load(f, src, ulong(ld), ulong2(0, 0), transpose);
}
template <class T>
FA_ALWAYS_INLINE void fa_load_tile(thread fa_frag& f, threadgroup const T* src, int ld,
                                   bool transpose, uint lane) {
    const uint quad = lane / 4;
    const uint row = (quad & 4) + (lane / 2) % 4, col = (quad & 2) * 2 + (lane % 2) * 2;
    FA_UNROLL
    for (uint i = 0; i < 2; ++i) {
        const ulong r = transpose ? col + i : row;
        const ulong c = transpose ? row : col + i;
        f.thread_elements()[i] = float(src[r * ulong(ld) + c]);
    }
}

// A fragment's lane elements times s (1 where the tile already holds the
// scale: a no-op the compiler removes).
FA_ALWAYS_INLINE void fa_scale_frag(thread fa_frag& f, float s) {
    f.thread_elements()[0] *= s;
    f.thread_elements()[1] *= s;
}

// Writes the lane's elements of a row of N8 fragments (columns c0 + 8 * n8
// + col and the next) times `scale` to `out`, rounded to T, skipping
// columns at or past D.
template <int N8, class T>
FA_INLINE void fa_store_row(device T* out, const thread fa_frag (&A)[N8], int c0, int col, int D,
                            float scale) {
    FA_UNROLL
    for (int n8 = 0; n8 < N8; ++n8) {
        const int c = c0 + n8 * 8 + col;
        if (fa_head_full || c < D) out[c] = T(A[n8].thread_elements()[0] * scale);
        if (fa_head_full || c + 1 < D) out[c + 1] = T(A[n8].thread_elements()[1] * scale);
    }
}

// Copies `rows` rows of HD columns (the first D of each from `src`, rows
// `pitch` elements apart, times `scale`; zeros past D and past `rows`) into
// a staged tile of STAGE rows of pitch FA_LD(HD), in the input's type T
// (a 16-bit tile is staged with scale 1: FaStorage). All threads of the
// group take part. Returns whether this thread staged a NaN or an inf.
template <int HD, int STAGE, class T>
FA_INLINE bool fa_stage(threadgroup T* tile, device const T* src, fa_long pitch, int rows,
                        int D, float scale, uint tid) {
    const int quads = HD / 4;
    bool nonfinite = false;
    for (int e = int(tid); e < STAGE * quads; e += FA_THREADS) {
        const int r = e / quads;
        const int c = (e - r * quads) * 4;
        float4 x = float4(0.0f);
        if (r < rows) {
            device const T* row = src + fa_long(r) * pitch;
            if (fa_head_vec4 && c < D) {
                x = fa_load4(row + c);
            } else {
                for (int i = 0; i < 4; ++i) x[i] = c + i < D ? float(row[c + i]) : 0.0f;
            }
        }
        threadgroup T* dst = tile + r * FA_LD(HD) + c;
        for (int i = 0; i < 4; ++i) {
            const float y = x[i] * scale;
            dst[i] = T(y);
            nonfinite = nonfinite || !isfinite(y);
        }
    }
    return nonfinite;
}

// Whether any thread of the group staged a NaN or an inf: each SIMD group
// posts its answer before the barrier that ends the staging, and everyone
// reads all of them after it (`flags` holds one int per SIMD group).
FA_INLINE void fa_post_nonfinite(threadgroup int* flags, bool mine, uint sg, uint lane) {
    const int any = simd_max(mine ? 1 : 0);
    if (lane == 0) flags[sg] = any;
}
FA_INLINE bool fa_any_nonfinite(threadgroup const int* flags) {
    int any = 0;
    for (int s = 0; s < FA_SIMDGROUPS; ++s) any |= flags[s];
    return any != 0;
}

// The lane holding element (row, col) of a fragment, col even (the inverse
// of fa_lane: lane bits 4, 2, 1 are the row's, bits 3 and 0 the column's).
FA_INLINE ushort fa_lane_of(int row, int col) {
    return ushort(((row >> 2) << 4) | ((col >> 2) << 3) | (((row >> 1) & 1) << 2) |
                  ((row & 1) << 1) | ((col >> 1) & 1));
}

// acc += A B over only the columns k of A (k_first + k as a key or query)
// that the lane's row sees, [begin, end): the exact path for a masked tile
// whose B holds a NaN or an inf, where a matrix multiply would give the
// rows that do not see it 0 * inf = NaN. A is K8 fragments of 8 x 8 (an
// element at a time, gathered by shuffles), acc N8 fragments of output
// columns, B the staged rows k at pitch ld from the output's first column,
// each element times b_scale (FaStorage). Slow, and only taken for such tiles.
template <int K8, int N8, class T>
FA_INLINE void fa_masked_accumulate(thread fa_frag (&acc)[N8], const thread fa_frag (&A)[K8],
                                    threadgroup const T* B, int ld, FaLane at, int k_first,
                                    int begin, int end, float b_scale) {
    for (int k = 0; k < K8 * 8; ++k) {
        // Every lane shuffles (uniform control flow); the value is the
        // lane's row's element k of A.
        // (no run-time index into a fragment: that would put it in memory)
        const ushort src = fa_lane_of(at.row, k & 6);
        float a = 0.0f;
        FA_UNROLL
        for (int k8 = 0; k8 < K8; ++k8) {
            const float x0 = simd_shuffle(A[k8].thread_elements()[0], src);
            const float x1 = simd_shuffle(A[k8].thread_elements()[1], src);
            if (k8 == k / 8) a = (k & 1) ? x1 : x0;
        }
        if (k_first + k < begin || k_first + k >= end) continue;
        threadgroup const T* b = B + k * ld + at.col;
        FA_UNROLL
        for (int n8 = 0; n8 < N8; ++n8) {
            acc[n8].thread_elements()[0] =
                fma(a, float(b[n8 * 8]) * b_scale, acc[n8].thread_elements()[0]);
            acc[n8].thread_elements()[1] =
                fma(a, float(b[n8 * 8 + 1]) * b_scale, acc[n8].thread_elements()[1]);
        }
    }
}

// The 8 x HD rows of one operand that a SIMD group multiplies by, as
// fragments (frag(d8) is columns 8*d8 .. 8*d8+7), scaled by `scale`. With
// IN_REGISTERS they are loaded once and live in HD/4 registers per thread;
// otherwise each frag() loads the lane's two elements again from device
// memory. Rows the SIMD group does not own (row == 0) are zero.
template <int HD, bool IN_REGISTERS, class T>
struct FaRowFragments;

template <int HD, class T>
struct FaRowFragments<HD, true, T> {
    fa_frag f[HD / 8];

    FA_INLINE void load(device const T* row, int col, int D, float scale) {
        FA_UNROLL
        for (int d8 = 0; d8 < HD / 8; ++d8) {
            const float2 x = row ? fa_load_pair(row, d8 * 8 + col, D) : float2(0.0f);
            f[d8].thread_elements()[0] = x[0] * scale;
            f[d8].thread_elements()[1] = x[1] * scale;
        }
    }
    FA_INLINE fa_frag frag(int d8) const { return f[d8]; }
};

template <int HD, class T>
struct FaRowFragments<HD, false, T> {
    device const T* row_;
    int col_, D_;
    float scale_;

    FA_INLINE void load(device const T* row, int col, int D, float scale) {
        row_ = row, col_ = col, D_ = D, scale_ = scale;
    }
    FA_INLINE fa_frag frag(int d8) const {
        const float2 x = row_ ? fa_load_pair(row_, d8 * 8 + col_, D_) : float2(0.0f);
        fa_frag m;
        m.thread_elements()[0] = x[0] * scale_;
        m.thread_elements()[1] = x[1] * scale_;
        return m;
    }
};

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

// True when the mask hides every score of a SIMD group's tile from the
// rows (or keys) its lanes hold, so the tile is skipped as the cpu engine
// skips it: each lane checks the columns c0 + [0, WIDTH) it meets
// (col, col + 1 of each 8-column fragment) that its band [begin, end) lets
// it see, at mask offset mods.mask_base + c * stride. Only a false (bool)
// or -inf (float) entry hides; NaN does not.
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
            const fa_long at = mods.mask_base + fa_long(c) * stride;
            if (fa_score_mods & FA_SCORE_MASK_BOOL)
                visible |= int(mask[at] != 0);
            else
                visible |= int(reinterpret_cast<device const float*>(mask)[at] != -INFINITY);
        }
    }
    return simd_max(visible) == 0;
}

// The options on the score s of query row t and key j, which the band lets
// it see: softcap, then ALiBi, then the mask (-inf hides the key);
// mask_offset is the element's offset past mods.mask_base. dcap gets
// d(softcap)/ds (1 without a softcap).
FA_INLINE float fa_score_mod(constant FlashParams& p, constant FlashScoreParams& sp,
                             FaScoreMods mods, device const uchar* mask, int t, int j,
                             fa_long mask_offset, float s, thread float& dcap) {
    dcap = 1.0f;
    if (fa_score_mods & FA_SCORE_SOFTCAP) {
        const float th = fa_tanh(s / sp.softcap);
        s = sp.softcap * th;
        dcap = fma(-th, th, 1.0f);
    }
    if (fa_score_mods & FA_SCORE_ALIBI) s = fma(-mods.slope, abs(float(t + p.Tk - p.Tq - j)), s);
    if (fa_score_mods & (FA_SCORE_MASK_BOOL | FA_SCORE_MASK_FLOAT)) {
        const fa_long at = mods.mask_base + mask_offset;
        if (fa_score_mods & FA_SCORE_MASK_BOOL)
            s = mask[at] != 0 ? s : -INFINITY;
        else
            s += reinterpret_cast<device const float*>(mask)[at];
    }
    return s;
}
