// Tile-level building blocks shared by the forward and backward passes:
// block sizes, the band of keys a block of queries sees, and the small
// matrix products on tiles held in per-thread scratch.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "flash_params.h"

namespace flashattn::cpu {

constexpr int kBlockQ = 64;  // query rows per tile
constexpr int kBlockK = 64;  // keys per tile

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Keys [begin, end) that some row of [i0, i1) sees; rows' bands are monotone
// in i, so the first row bounds the start and the last row the end.
struct Range {
    int64_t begin, end;
};
inline Range keys_of_rows(const FlashParams& p, int64_t i0, int64_t i1) {
    return {fa_key_begin(i0, p.Tq, p.Tk, p.window_left),
            fa_key_end(i1 - 1, p.Tq, p.Tk, p.window_right)};
}
inline Range rows_of_keys(const FlashParams& p, int64_t j0, int64_t j1) {
    return {fa_query_begin(j0, p.Tq, p.Tk, p.window_right),
            fa_query_end(j1 - 1, p.Tq, p.Tk, p.window_left)};
}
// True when every row of [i0, i1) sees every key of [j0, j1): no mask needed.
inline bool block_inside_band(const FlashParams& p, int64_t i0, int64_t i1, int64_t j0,
                              int64_t j1) {
    return j0 >= fa_key_begin(i1 - 1, p.Tq, p.Tk, p.window_left) &&
           j1 <= fa_key_end(i0, p.Tq, p.Tk, p.window_right);
}
// The keys of row i inside the tile [j0, j0 + n), as tile columns [lo, hi).
inline void row_columns(const FlashParams& p, int64_t i, int64_t j0, int n, int& lo, int& hi) {
    const int64_t b = fa_key_begin(i, p.Tq, p.Tk, p.window_left) - j0;
    const int64_t e = fa_key_end(i, p.Tq, p.Tk, p.window_right) - j0;
    lo = int(std::clamp<int64_t>(b, 0, n));
    hi = int(std::clamp<int64_t>(e, 0, n));
    if (hi < lo) hi = lo;
}

// C[m, n] += sum_k A[m, k] * B[k, n] for m < M, n < N, k < K, where A[m, k]
// is A[m * am + k * ak] (so a transposed A costs nothing) and B, C are
// row-major with leading dimensions ldb, ldc.
inline void gemm_acc(int M, int N, int K, const float* A, int64_t am, int64_t ak,
                     const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc) {
    for (int m = 0; m < M; ++m) {
        float* __restrict c = C + m * ldc;
        for (int k = 0; k < K; ++k) {
            const float a = A[m * am + k * ak];
            const float* __restrict b = B + k * ldb;
            for (int n = 0; n < N; ++n) c[n] += a * b[n];
        }
    }
}

// Per-thread scratch, grown on demand and kept for the thread's life so a
// call allocates nothing per tile.
inline float* scratch(size_t n_floats, int slot) {
    thread_local std::vector<float> buffers[8];
    auto& buf = buffers[slot];
    if (buf.size() < n_floats) buf.resize(n_floats);
    return buf.data();
}

}  // namespace flashattn::cpu
