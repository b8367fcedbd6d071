// Forward pass of the cpu engine (FlashAttention-2 split): one task per
// (batch, head, block of query rows); each walks the key blocks of its band
// with an online softmax and writes o and lse = log(sum exp(scale * q.k)).
//
// Tiles are held transposed, keys x queries, so the queries of a tile run
// along the vector lanes: the softmax statistics (max, sum, rescale) of W
// rows are one vector and need no horizontal reductions, and K is read in
// place as the broadcast operand of S^T = K Q^T.
//
// Once every row of a tile has a running max m, a key block wholly inside
// the band takes a one-pass path: exponentials against the (possibly stale)
// m are taken as S^T leaves the registers, and m is kept unless some score
// exceeds it by more than kHeadroom (then the block is redone the two-pass
// way). Probabilities up to e^kHeadroom relative to m lose no accuracy in
// float, and skipping the rescale saves a pass over the tile and over O.
#include <cmath>
#include <cstring>

#include "cpu/isa_begin.h"  // opens the per-ISA region
#include "cpu/kernels.h"
#include "cpu/gemm.h"
#include "cpu/thread_pool.h"
#include "cpu/tiles.h"
#include "cpu/score_mods.h"

FLASHATTN_CPU_KERNELS(FLASHATTN_CPU_ISA)

namespace flashattn::cpu::FLASHATTN_CPU_ISA {
namespace {

using simd::splat;
using simd::vi;

constexpr float kHeadroom = 11.0f;  // e^11: about 2^16

// The score options on S^T as it leaves the registers: rows are keys from
// key0, lanes queries from query0; bias is the mask tile (row stride ld) or null.
struct ModsEpilogue {
    const ScoreMods* mods;  // null: plain attention
    int64_t key0, query0;
    const float* bias;
    int64_t ld;

    template <int MR, int NV>
    void apply(vf (&c)[MR][NV]) const {
        if (!mods) return;
        const vi lane = simd::iota();
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) {
                const int32_t diff = int32_t(query0 + v * W + mods->offset - (key0 + r));
                c[r][v] = mods->apply(c[r][v], lane + diff,
                                      bias ? bias + r * ld + v * W : nullptr, nullptr);
            }
    }
    ModsEpilogue at(int m, int n) const {
        return {mods, key0 + m, query0 + n, bias ? bias + m * ld + n : nullptr, ld};
    }
};

// exp(S^T - m) as S^T leaves the registers (after the score options), with
// each column's max score and sum of exponentials folded into colmax and colsum.
struct ScoreEpilogue {
    const float* m;
    float* colmax;
    float* colsum;
    ModsEpilogue mods;

    template <int MR, int NV>
    void apply(vf (&c)[MR][NV]) const {
        mods.apply(c);
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) {
            const vf ref = simd::load(m + v * W);
            vf mx = c[0][v];
#pragma GCC unroll 16
            for (int r = 1; r < MR; ++r) mx = simd::max(mx, c[r][v]);
            vf sum{};
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) {
                c[r][v] = simd::exp2((c[r][v] - ref) * splat(kLog2e));
                sum += c[r][v];
            }
            simd::store(colmax + v * W, simd::max(simd::load(colmax + v * W), mx));
            simd::store(colsum + v * W, simd::load(colsum + v * W) + sum);
        }
    }
    ScoreEpilogue at(int mr, int n) const {
        return {m + n, colmax + n, colsum + n, mods.at(mr, n)};
    }
};

// One key block's online-softmax step on the scores S^T (nk x BQ, already
// scaled): masks, updates the running max m and sum l, leaves the
// unnormalised probabilities in S^T and the rescale of the old rows in corr.
void online_softmax(float* ST, int nk, int BQ, bool full, const int* lo, const int* hi, float* m,
                    float* l, float* corr) {
    const vi lane = simd::iota();
    const vf neg_inf = splat(-simd::kInf);
    for (int c = 0; c < BQ; c += W) {
        vf mx = neg_inf;
        if (full) {
            for (int j = 0; j < nk; ++j) mx = simd::max(mx, simd::load(ST + j * BQ + c));
        } else {
            const vi col = lane + c;
            for (int j = 0; j < nk; ++j) {
                const vi in = simd::in_range(col, lo[j], hi[j]);
                const vf s = simd::select(in, simd::load(ST + j * BQ + c), neg_inf);
                simd::store(ST + j * BQ + c, s);
                mx = simd::max(mx, s);
            }
        }
        const vf m_old = simd::load(m + c);
        const vf m_new = simd::max(m_old, mx);
        // A row that has seen no key yet keeps m = -inf; exponents use 0 so
        // that -inf - -inf never happens.
        const vf m_use = simd::select(m_new == neg_inf, vf{}, m_new);
        const vf rescale = simd::exp2((m_old - m_use) * splat(kLog2e));
        vf sum{};
        for (int j = 0; j < nk; ++j) {
            const vf e = simd::exp2((simd::load(ST + j * BQ + c) - m_use) * splat(kLog2e));
            simd::store(ST + j * BQ + c, e);
            sum += e;
        }
        simd::store(l + c, simd::fma(simd::load(l + c), rescale, sum));
        simd::store(m + c, m_new);
        simd::store(corr + c, rescale);
    }
}

void forward_block(const FlashParams& p, const ForwardIO& io, int64_t b, int64_t h, int64_t i0,
                   int nq, int BQ) {
    const int D = p.D;
    const int Dp = int(round_up(D, W));
    const int64_t hk = h / p.group;
    const float* q0 = io.q + b * p.q.b + h * p.q.h;
    const float* k0 = io.k + b * p.k.b + hk * p.k.h;
    const float* v0 = io.v + b * p.v.b + hk * p.v.h;
    float* o0 = io.o + b * p.o.b + h * p.o.h;
    float* lse0 = io.lse + (b * p.H + h) * int64_t(p.Tq);

    float* Qt = scratch(size_t(D) * BQ, 0);         // D x BQ, scaled
    float* Vp = scratch(size_t(kBlockK) * Dp, 1);   // keys x Dp, zero-padded
    float* ST = scratch(size_t(kBlockK) * BQ, 2);   // keys x queries
    float* O = scratch(size_t(BQ) * Dp, 3);
    float* m = scratch(size_t(BQ), 4);
    float* l = scratch(size_t(BQ), 5);
    float* corr = scratch(size_t(BQ), 6);
    float* colmax = scratch(size_t(BQ), 7);
    float* colsum = scratch(size_t(BQ), 8);
    bool have_max = false;  // every row has seen a key: m is finite
    int lo[kBlockK], hi[kBlockK];
    const ScoreMods mods = ScoreMods::of(p, io.score, b, h);
    const bool masked = p.score_mods & (FA_SCORE_MASK_BOOL | FA_SCORE_MASK_FLOAT);
    float* bias = masked ? scratch(size_t(kBlockK) * BQ, 10) : nullptr;  // the mask, keys x queries

    // Scores stay in natural units, scale * q times k (the backward
    // recomputes them bit for bit), until m is subtracted: s - m is exact
    // however large both are. Rows are first gathered whole (wide loads keep
    // many cache misses in flight), then transposed from L1.
    float* Qr = scratch(size_t(BQ) * D, 9);
    for (int r = 0; r < nq; ++r) std::memcpy(Qr + r * D, q0 + (i0 + r) * p.q.t, sizeof(float) * D);
    for (int d = 0; d < D; ++d) {
        for (int r = 0; r < nq; ++r) Qt[d * BQ + r] = Qr[r * D + d] * p.scale;
        for (int r = nq; r < BQ; ++r) Qt[d * BQ + r] = 0.0f;
    }
    std::memset(O, 0, sizeof(float) * size_t(BQ) * Dp);
    // A sink is one more logit, with a zero value: it starts the running
    // max and sum (a sink of -inf, or none, starts them empty).
    const float sink = io.score.sinks ? io.score.sinks[h] : -simd::kInf;
    for (int r = 0; r < BQ; ++r) m[r] = sink, l[r] = sink == -simd::kInf ? 0.0f : 1.0f;
    for (int j = 0; j < kBlockK; ++j)
        for (int d = D; d < Dp; ++d) Vp[j * Dp + d] = 0.0f;

    const Range keys = keys_of_rows(p, i0, i0 + nq);
    // Key blocks in order, except with ALiBi: its bias falls with the
    // distance from the diagonal, so the blocks go from the one holding the
    // first row's diagonal outwards (down, then up). The running max then
    // starts near its final value and later blocks rarely exceed it by the
    // headroom, which would make each of them a second pass.
    const int64_t n_blocks = (keys.end - keys.begin + kBlockK - 1) / kBlockK;
    const int64_t first = mods.alibi && n_blocks > 0
                              ? std::clamp<int64_t>((i0 + p.Tk - p.Tq - keys.begin) / kBlockK, 0,
                                                    n_blocks - 1)
                              : 0;
    for (int64_t n = 0; n < n_blocks; ++n) {
        const int64_t kb = n <= first ? first - n : n;  // first, first - 1, ..., 0, first + 1, ...
        const int64_t j0 = keys.begin + kb * kBlockK;
        const int nk = int(std::min<int64_t>(kBlockK, keys.end - j0));
        if (masked && !mask_tile(p, io.score, b, h, i0, nq, j0, nk, true, bias, BQ, BQ))
            continue;  // the mask hides every score of this block
        const ModsEpilogue mod{mods.active ? &mods : nullptr, j0, i0, bias, BQ};
        const bool full = block_inside_band(p, i0, i0 + nq, j0, j0 + nk);
        // V rows serve as the B operand in place when they need no padding.
        const float* Vb = v0 + j0 * p.v.t;
        int64_t ldv = p.v.t;
        if (D != Dp) {
            for (int j = 0; j < nk; ++j)
                std::memcpy(Vp + j * Dp, v0 + (j0 + j) * p.v.t, sizeof(float) * D);
            Vb = Vp, ldv = Dp;
        }
        const float* Kb = k0 + j0 * p.k.t;  // K read in place: its rows are broadcast
        if (full && have_max) {
            for (int col = 0; col < BQ; col += W) {
                simd::store(colmax + col, splat(-simd::kInf));
                simd::store(colsum + col, vf{});
            }
            gemm<false>(nk, BQ, D, Kb, p.k.t, Qt, BQ, ST, BQ, nullptr, false,
                        ScoreEpilogue{m, colmax, colsum, mod});
            bool stale = false;
            for (int r = 0; r < nq; ++r) stale |= colmax[r] > m[r] + kHeadroom;
            if (!stale) {
                for (int col = 0; col < BQ; col += W)
                    simd::store(l + col, simd::load(l + col) + simd::load(colsum + col));
                gemm<true>(nq, Dp, nk, ST, BQ, Vb, ldv, O, Dp, nullptr, true);
                continue;
            }
        }
        // The two-pass step: S^T = K Q^T, then max, rescale and exponentials.
        gemm<false>(nk, BQ, D, Kb, p.k.t, Qt, BQ, ST, BQ, nullptr, false, mod);
        if (!full)
            for (int j = 0; j < nk; ++j) key_columns(p, j0 + j, i0, nq, lo[j], hi[j]);
        online_softmax(ST, nk, BQ, full, lo, hi, m, l, corr);
        // O = O * corr + P V, with P = (S^T)^T. A masked P entry is 0, and 0
        // times an inf or NaN in V would reach a row that does not see it.
        if (full || all_finite(Vb, nk, D, ldv)) {
            gemm<true>(nq, Dp, nk, ST, BQ, Vb, ldv, O, Dp, corr, true);
        } else {
            int klo[kBlockQ], khi[kBlockQ];
            for (int r = 0; r < nq; ++r) row_keys(p, i0 + r, j0, nk, klo[r], khi[r]);
            gemm_ranged<true>(nq, Dp, klo, khi, ST, BQ, Vb, ldv, O, Dp, corr, true);
        }
        have_max = true;
        for (int r = 0; r < nq; ++r) have_max &= m[r] != -simd::kInf;
    }

    for (int r = 0; r < nq; ++r) {
        float* dst = o0 + (i0 + r) * p.o.t;
        // Geometry, and then l, decide: a NaN or +inf score makes l NaN, and
        // that row's output must say so; l == 0 means every score it saw was
        // -inf, so every key dropped out and it is a row that sees no key.
        if ((row_sees_keys(p, i0 + r) || io.score.sinks) && l[r] != 0.0f) {
            const float inv = 1.0f / l[r];
            for (int d = 0; d < D; ++d) dst[d] = O[r * Dp + d] * inv;
            lse0[i0 + r] = m[r] + std::log(l[r]);
        } else {  // a row that sees no key (nor a sink)
            for (int d = 0; d < D; ++d) dst[d] = 0.0f;
            lse0[i0 + r] = -simd::kInf;
        }
    }
}

}  // namespace

void attention_forward(const FlashParams& p, const ForwardIO& io) {
    const int BQ = query_block(p, W);
    const int64_t blocks = (int64_t(p.Tq) + BQ - 1) / BQ;
    const int64_t heads = int64_t(p.B) * p.H;
    // Consecutive tasks share a head, so its K and V stay in cache; within a
    // head the last query blocks (the most keys under a causal mask) come
    // first, so the tasks left at the end are small and threads finish together.
    parallel_for(heads * blocks, [&](int64_t t) {
        const int64_t qb = blocks - 1 - t % blocks;
        const int64_t bh = t / blocks;
        const int64_t i0 = qb * BQ;
        forward_block(p, io, bh / p.H, bh % p.H, i0, int(std::min<int64_t>(BQ, p.Tq - i0)), BQ);
    });
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA

#include "cpu/isa_end.h"
