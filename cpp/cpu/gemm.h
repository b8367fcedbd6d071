// Register-blocked products of small tiles, the engine's only heavy loops:
// C = epilogue((C * rowscale | 0) + A B) for tiles in L1/L2. The micro-kernel
// keeps an MR x (NV * W) block of C in vector registers while streaming one
// row of B and broadcasting one element of A per row, per step of k. An
// epilogue maps each finished vector before it is stored (the softmax work of
// the backward, done while the values are still in registers).
#pragma once
#include "cpu/simd.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

using simd::vf;
using simd::W;

// Column vectors per micro-kernel call, and rows for each width: about 16-24
// accumulators, leaving registers for the B row and the broadcast. AVX-512
// and NEON have 32 vector registers, AVX2 16; the baseline (SSE2) 16.
#if defined(FLASHATTN_SIMD_AVX512) || defined(FLASHATTN_SIMD_NEON)
inline constexpr int kMaxNV = 4;
constexpr int rows_for(int nv) { return nv >= 4 ? 6 : nv == 3 ? 7 : nv == 2 ? 8 : 8; }
#elif defined(FLASHATTN_SIMD_AVX2)
inline constexpr int kMaxNV = 3;
constexpr int rows_for(int nv) { return nv >= 3 ? 4 : nv == 2 ? 6 : 8; }
#else
inline constexpr int kMaxNV = 2;
constexpr int rows_for(int nv) { return nv >= 2 ? 4 : 6; }
#endif

// The identity epilogue. An epilogue's apply(c) rewrites the finished MR x NV
// register block c before it is stored (and may reduce it, e.g. per column),
// and epi.at(m, n) gives the epilogue for the block m rows and n columns on.
struct Identity {
    template <int MR, int NV>
    void apply(vf (&)[MR][NV]) const {}
    Identity at(int, int) const { return *this; }
};

// epi after each finished vector is multiplied by s (products of unscaled
// inputs, such as AMX's: the scale comes after).
template <class Epi>
struct ScaledEpilogue {
    float s;
    Epi epi;

    template <int MR, int NV>
    void apply(vf (&c)[MR][NV]) const {
        const vf sv = simd::splat(s);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) c[r][v] *= sv;
        epi.template apply<MR, NV>(c);
    }
    ScaledEpilogue at(int m, int n) const { return {s, epi.at(m, n)}; }
};

// Runs epi over C (M x N, N a multiple of W, row stride ldc) in place, in the
// blocks gemm would hand it: for products computed elsewhere (AMX tiles).
template <class Epi>
inline void apply_epilogue(float* C, int M, int N, int64_t ldc, const Epi& epi) {
    constexpr int MR = 8;
    for (int n = 0; n < N; n += W) {
        const auto col = epi.at(0, n);
        int m = 0;
        for (; m + MR <= M; m += MR) {
            vf c[MR][1];
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) c[r][0] = simd::load(C + (m + r) * ldc + n);
            col.at(m, 0).template apply<MR, 1>(c);
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) simd::store(C + (m + r) * ldc + n, c[r][0]);
        }
        for (; m < M; ++m) {
            vf c[1][1] = {{simd::load(C + m * ldc + n)}};
            col.at(m, 0).template apply<1, 1>(c);
            simd::store(C + m * ldc + n, c[0][0]);
        }
    }
}

// The sum over d of a product over the head dimension (q.k, dO.v: the
// scores and dP, and delta = dO.o) is taken in chunks of d_chunk(D)
// consecutive terms, [0, c), [c, 2c), ..., each a chain of FMAs from zero,
// and the chunks' sums added in order: ((t0 + t1) + t2) + ... (issue 32
// item 8). The grouping depends on D and d only, so every path that sums a
// score (masked or not, banded, decoding, varlen, the backward's
// recomputation) rounds it the same way. One chain over all of D rounds
// each step at the size of the whole sum: at score spreads of 10-100
// (|scale q.k| of tens) that error reached o through exp: o's root mean
// square error was 1.9-2.4x a float32 einsum's (NumPy sums each SIMD
// lane's terms apart, then adds the lanes), 0.8-1.0x in chunks
// (tests/python/test_score_spread.py, docs/semantics.md). Sums over keys (P V, dS K,
// P^T dO, dS^T Q) stay one chain per key block: their error does not grow
// with the spread, and masked, banded and skipped keys must leave them bit
// for bit as they are.
// About 2 sqrt(D) terms: an emulation of the sums (float64 products,
// float32 rounding per step) put o's RMS error at 0.8-1.1x NumPy's with
// these, 1.2-1.4x with chunks of 32 at D = 64, 2-2.7x with one chain.
constexpr int d_chunk(int D) { return D <= 32 ? 8 : D <= 64 ? 16 : 32; }

// c[r][v] += A[r, k] B[k, v] for k in [k0, k1), one FMA chain per entry.
// Always inlined: called apart, c would live in memory (GCC left some
// instantiations out of line: the backward was 14% slower).
template <int MR, int NV, bool TA>
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
inline void fma_chain(int k0, int k1, const float* __restrict A, int64_t lda,
                      const float* __restrict B, int64_t ldb, vf (&c)[MR][NV]) {
    for (int k = k0; k < k1; ++k) {
        const float* __restrict b = B + k * ldb;
        vf bv[NV];
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) bv[v] = simd::load(b + v * W);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const vf a = simd::splat(TA ? A[k * lda + r] : A[r * lda + k]);
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) c[r][v] = simd::fma(a, bv[v], c[r][v]);
        }
    }
}

// A[r, k] is A[r * lda + k], or A[k * lda + r] when TA (a transposed tile
// costs nothing: the element is broadcast either way). kc > 0 (with
// accumulate false only): the sum over K in chunks of kc terms, as d_chunk
// says; the earlier chunks' sum waits in C while a chunk is summed in the
// registers (a second register block would not fit).
template <int MR, int NV, bool TA, class Epi>
inline void micro_kernel(int K, const float* __restrict A, int64_t lda, const float* __restrict B,
                         int64_t ldb, float* __restrict C, int64_t ldc,
                         const float* __restrict rowscale, bool accumulate, const Epi& epi,
                         int kc = 0) {
    vf c[MR][NV];
    if (accumulate && rowscale) {
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const vf s = simd::splat(rowscale[r]);
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) c[r][v] = simd::load(C + r * ldc + v * W) * s;
        }
    } else if (accumulate) {
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) c[r][v] = simd::load(C + r * ldc + v * W);
    } else {
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) c[r][v] = vf{};
    }
    // One chain (kc <= 0), or chunk after chunk: each chunk's sum, from
    // zero, is added to the earlier chunks' sum kept in C.
    const int step = kc > 0 ? kc : K;
    for (int k0 = 0;;) {
        const int k1 = K - k0 > step ? k0 + step : K;
        fma_chain<MR, NV, TA>(k0, k1, A, lda, B, ldb, c);
        if (k0 > 0)
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
                for (int v = 0; v < NV; ++v) c[r][v] = simd::load(C + r * ldc + v * W) + c[r][v];
        if (k1 == K) break;
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) simd::store(C + r * ldc + v * W, c[r][v]), c[r][v] = vf{};
        k0 = k1;
    }
    epi.template apply<MR, NV>(c);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) simd::store(C + r * ldc + v * W, c[r][v]);
}

namespace detail {

template <int NV, bool TA, class Epi, int... Ms>
inline void row_tail(int rows, std::integer_sequence<int, Ms...>, int K, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                     const float* rowscale, bool accumulate, const Epi& epi, int kc) {
    ((rows == Ms + 1 ? micro_kernel<Ms + 1, NV, TA>(K, A, lda, B, ldb, C, ldc, rowscale,
                                                    accumulate, epi, kc)
                     : void()),
     ...);
}

// Row blocks of MR from m; with k_lo (and k_hi) each block contracts over
// the union of its rows' ranges of K only, else over all of K.
template <int NV, bool TA, class Epi>
inline void gemm_columns(int M, int K, const float* A, int64_t lda, const float* B, int64_t ldb,
                         float* C, int64_t ldc, const float* rowscale, bool accumulate,
                         const Epi& epi, const int* k_lo, const int* k_hi, int kc) {
    constexpr int MR = rows_for(NV);
    for (int m = 0; m < M; m += MR) {
        const int rows = M - m < MR ? M - m : MR;
        int k0 = 0, k1 = K;
        if (k_lo) {
            k0 = K, k1 = 0;
            for (int r = m; r < m + rows; ++r)
                if (k_lo[r] < k_hi[r]) k0 = std::min(k0, k_lo[r]), k1 = std::max(k1, k_hi[r]);
            if (k1 < k0) k0 = k1 = 0;  // no row contracts: C = C * rowscale (or 0)
        }
        const float* a = TA ? A + int64_t(k0) * lda + m : A + m * lda + k0;
        const float* b = B + int64_t(k0) * ldb;
        const float* s = rowscale ? rowscale + m : nullptr;
        if (rows == MR)
            micro_kernel<MR, NV, TA>(k1 - k0, a, lda, b, ldb, C + m * ldc, ldc, s, accumulate,
                                     epi.at(m, 0), kc);
        else
            row_tail<NV, TA>(rows, std::make_integer_sequence<int, MR - 1>(), k1 - k0, a, lda, b,
                             ldb, C + m * ldc, ldc, s, accumulate, epi.at(m, 0), kc);
    }
}

}  // namespace detail

// C[M x N] = epi((accumulate ? C * rowscale : 0) + A[M x K] B[K x N]), where
// N is a multiple of W, B and C are row-major (ldb, ldc) and rowscale (one
// factor per row of C) may be null for 1.
//
// With k_lo and k_hi (one range [k_lo[r], k_hi[r]) of K per row of C, or
// null), each block of rows the micro-kernel holds contracts over the union
// of its rows' ranges only: the same product where the entries of A outside
// a row's range are zeros (masked probabilities) and B is finite, without
// the work on them (the blocks a causal band cuts).
template <bool TA, class Epi = Identity>
inline void gemm(int M, int N, int K, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc, const float* rowscale, bool accumulate,
                 const Epi& epi = Epi{}, const int* k_lo = nullptr, const int* k_hi = nullptr,
                 int kc = 0) {
    for (int n = 0; n < N;) {
        // Widest column blocks first, but a last one vector wide (a load
        // per FMA row, bound by the broadcasts) is avoided: with one vector
        // more than kMaxNV left, two blocks share them (AVX2: D = 32 as 2 + 2,
        // not 3 + 1).
        const int left = (N - n) / W;
        const int nv = left == kMaxNV + 1 ? (left + 1) / 2 : left < kMaxNV ? left : kMaxNV;
        switch (nv) {
#if defined(FLASHATTN_SIMD_AVX512) || defined(FLASHATTN_SIMD_NEON)
            case 4:
                detail::gemm_columns<4, TA>(M, K, A, lda, B + n, ldb, C + n, ldc, rowscale,
                                            accumulate, epi.at(0, n), k_lo, k_hi, kc);
                break;
#endif
#if defined(FLASHATTN_SIMD_AVX512) || defined(FLASHATTN_SIMD_AVX2) || defined(FLASHATTN_SIMD_NEON)
            case 3:
                detail::gemm_columns<3, TA>(M, K, A, lda, B + n, ldb, C + n, ldc, rowscale,
                                            accumulate, epi.at(0, n), k_lo, k_hi, kc);
                break;
#endif
            case 2:
                detail::gemm_columns<2, TA>(M, K, A, lda, B + n, ldb, C + n, ldc, rowscale,
                                            accumulate, epi.at(0, n), k_lo, k_hi, kc);
                break;
            default:
                detail::gemm_columns<1, TA>(M, K, A, lda, B + n, ldb, C + n, ldc, rowscale,
                                            accumulate, epi.at(0, n), k_lo, k_hi, kc);
                break;
        }
        n += nv * W;
    }
}

// C[M x N] = epi(A[M x D] B[D x N]) for a product over the head dimension
// (scores, dP), summed over d in the chunks d_chunk(D) says.
template <bool TA, class Epi = Identity>
inline void gemm_over_d(int M, int N, int D, const float* A, int64_t lda, const float* B,
                        int64_t ldb, float* C, int64_t ldc, const Epi& epi = Epi{}) {
    gemm<TA>(M, N, D, A, lda, B, ldb, C, ldc, nullptr, false, epi, nullptr, nullptr, d_chunk(D));
}

// gemm without an epilogue in which row r of C contracts over its own range
// [lo[r], hi[r]) of K only, less the k a mask hides from it: with `hidden`
// (the mask tile, -inf where hidden: entry (r, k) at hidden[r * hr + k * hk]),
// those are left out too. Where the entries of A outside a row's visible k are
// masked zeros, this is the same product, except that an inf or NaN in B
// facing a masked zero stays out of C (0 * inf would be NaN). Slow (one row,
// and one run of visible k, at a time): for the rare tiles that hold such values.
template <bool TA>
inline void gemm_ranged(int M, int N, const int* lo, const int* hi, const float* A, int64_t lda,
                        const float* B, int64_t ldb, float* C, int64_t ldc,
                        const float* rowscale, bool accumulate, const float* hidden = nullptr,
                        int64_t hr = 0, int64_t hk = 0) {
    auto run = [&](int r, int k0, int k1, bool first) {
        gemm<TA>(1, N, k1 - k0, TA ? A + k0 * lda + r : A + r * lda + k0, lda, B + k0 * ldb,
                 ldb, C + r * ldc, ldc, first && rowscale ? rowscale + r : nullptr,
                 accumulate || !first);
    };
    for (int r = 0; r < M; ++r) {
        const int k0 = lo[r], k1 = hi[r] > lo[r] ? hi[r] : lo[r];
        if (!hidden) {
            run(r, k0, k1, true);
            continue;
        }
        auto hides = [&](int k) { return hidden[r * hr + k * hk] == -simd::kInf; };
        bool first = true;
        for (int k = k0; k < k1;) {
            if (hides(k)) {
                ++k;
                continue;
            }
            int e = k + 1;
            while (e < k1 && !hides(e)) ++e;
            run(r, k, e, first);
            first = false;
            k = e;
        }
        if (first) run(r, k0, k0, true);  // nothing visible: C = C * rowscale (or 0)
    }
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
