// Backward pass of the cpu engine, FlashAttention-2 style and deterministic
// (no atomics): one task per (batch, kv head, chunk of key blocks) walks
// its key blocks; for each, every query tile of the head group that sees it
// recomputes P = exp(scale * S - lse) and dS, accumulates dK and dV for the
// block in scratch, and adds dS K into the task's own dQ partial. Partials
// are summed in chunk order at the end; the chunking depends on the shape
// only, so results never depend on the thread count.
//
// As in the forward, tiles are keys x queries with queries along the lanes.
#include <cmath>
#include <cstring>
#include <vector>

#include "core/params.h"
#include "cpu/attention.h"
#include "cpu/gemm.h"
#include "cpu/thread_pool.h"
#include "cpu/tiles.h"

namespace flashattn::cpu {
namespace {

using simd::splat;
using simd::vi;

// Per-(batch, head, query tile) inputs prepared once, contiguous and
// zero-padded: Q^T scaled to log2 units and scale * dO^T (D x BQ, for S^T and
// dP^T),
// Q and dO (BQ x Dp, for dK and dV), lse in log2 units (+inf for padding
// and empty rows, so their probabilities are 0) and scale * rowsum(dO * O).
// Strided rows of q and do, gathered once here instead of once per key block.
struct Prepared {
    int BQ, blocks, Dp;
    size_t tile;  // floats in one D x BQ (or BQ x Dp) tile
    AlignedBuffer qt, dot, qr, dor, lse2, delta;

    size_t index(int64_t b, int64_t h, int64_t qb, int H) const {
        return (size_t(b) * H + h) * blocks + qb;
    }
};

void prepare(const FlashParams& p, const BackwardIO& io, Prepared& s) {
    const int D = p.D, BQ = s.BQ;
    const float c = p.scale * kLog2e;
    const float scale = p.scale;
    const int64_t heads = int64_t(p.B) * p.H;
    parallel_for(heads * s.blocks, [&](int64_t t) {
        const int64_t bh = t / s.blocks, qb = t % s.blocks, b = bh / p.H, h = bh % p.H;
        const int64_t i0 = qb * BQ;
        const int nq = int(std::min<int64_t>(BQ, p.Tq - i0));
        const size_t at = s.index(b, h, qb, p.H);
        float* qt = s.qt.data() + at * s.tile;
        float* dot = s.dot.data() + at * s.tile;
        float* qr = s.qr.data() + at * s.tile;
        float* dor = s.dor.data() + at * s.tile;
        const int Dp = s.Dp;
        std::memset(qr, 0, sizeof(float) * s.tile);
        std::memset(dor, 0, sizeof(float) * s.tile);
        float* lse2 = s.lse2.data() + at * BQ;
        float* delta = s.delta.data() + at * BQ;
        const float* q0 = io.q + b * p.q.b + h * p.q.h;
        const float* do0 = io.dout + b * p.dout.b + h * p.dout.h;
        const float* o0 = io.o + b * p.o.b + h * p.o.h;
        const float* lse0 = io.lse + bh * int64_t(p.Tq);
        for (int r = 0; r < BQ; ++r) {
            if (r >= nq) {
                for (int d = 0; d < D; ++d) qt[d * BQ + r] = dot[d * BQ + r] = 0.0f;
                lse2[r] = simd::kInf;
                delta[r] = 0.0f;
                continue;
            }
            const int64_t i = i0 + r;
            const float* qs = q0 + i * p.q.t;
            const float* ds = do0 + i * p.dout.t;
            const float* os = o0 + i * p.o.t;
            float acc = 0.0f;
            for (int d = 0; d < D; ++d) {
                qt[d * BQ + r] = qs[d] * c;
                dot[d * BQ + r] = ds[d] * scale;
                qr[r * Dp + d] = qs[d];
                dor[r * Dp + d] = ds[d];
                acc += ds[d] * os[d];
            }
            delta[r] = acc * scale;
            lse2[r] = lse0[i] == -simd::kInf ? simd::kInf : lse0[i] * kLog2e;
        }
    });
}

// The split of each (batch, kv head)'s key blocks into chunks, one task
// each, and the query rows each chunk's dQ partial covers (whole tiles).
struct Chunk {
    int64_t kb0, kb1;    // key blocks [kb0, kb1)
    int64_t row0, row1;  // query rows [row0, row1), multiples of BQ (row1 may pass Tq)
    int64_t offset;      // rows of the partial before this chunk's, per head
};

std::vector<Chunk> plan_chunks(const FlashParams& p, int BQ, int64_t& rows_per_head) {
    const int64_t kblocks = (int64_t(p.Tk) + kBlockK - 1) / kBlockK;
    // Work of a key block: the query tiles that see it.
    std::vector<int64_t> work(size_t(kblocks), 0);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
        const Range r = rows_of_keys(p, kb * kBlockK, std::min<int64_t>(kb * kBlockK + kBlockK, p.Tk));
        if (r.begin < r.end) work[kb] = (r.end - 1) / BQ - r.begin / BQ + 1;
    }
    // Enough tasks to keep a few cores busy when B * Hkv is small, but no
    // more dQ partial memory than about the size of q (or 64 Mi floats).
    const int64_t kv_heads = int64_t(p.B) * p.Hkv;
    int64_t chunks = std::min<int64_t>((16 + kv_heads - 1) / kv_heads, kblocks);
    const double q_floats = double(p.B) * p.H * double(p.Tq) * round_up(p.D, W);
    const int64_t cap = int64_t(std::max(2.0, (64.0 * 1024 * 1024) / std::max(q_floats, 1.0)));
    chunks = std::max<int64_t>(1, std::min(chunks, cap));

    int64_t total = 0;
    for (int64_t w : work) total += w;
    std::vector<Chunk> plan;
    int64_t kb = 0, done = 0;
    rows_per_head = 0;
    for (int64_t c = 0; c < chunks && kb < kblocks; ++c) {
        Chunk ch{kb, kb, 0, 0, rows_per_head};
        const int64_t target = (total * (c + 1)) / chunks;
        while (ch.kb1 < kblocks && (done < target || ch.kb1 == ch.kb0 || c == chunks - 1)) {
            done += work[ch.kb1];
            ++ch.kb1;
        }
        kb = ch.kb1;
        const Range r = rows_of_keys(p, ch.kb0 * kBlockK,
                                     std::min<int64_t>(ch.kb1 * kBlockK, p.Tk));
        if (r.begin < r.end) {
            ch.row0 = r.begin / BQ * BQ;
            ch.row1 = round_up(r.end, BQ);
        }
        rows_per_head += ch.row1 - ch.row0;
        plan.push_back(ch);
    }
    return plan;
}

struct Context {
    const FlashParams& p;
    const BackwardIO& io;
    const Prepared& prep;
    const std::vector<Chunk>& chunks;
    float* partial;  // (B, H, rows_per_head, Dp): each chunk's dQ rows
    int64_t rows_per_head;
    int Dp;
};

// P^T = exp2(S^T - lse2) inside the band, 0 outside, computed as each vector
// of S^T leaves the registers. Masked: the tile crosses the band's edge, and
// row r (key) keeps the columns (queries) [lo[r], hi[r]).
template <bool Masked>
struct ProbabilityEpilogue {
    const float* lse2;  // per column, from this block's first column
    const int* lo;      // per row, from this block's first row
    const int* hi;
    int col0;

    template <int MR, int NV>
    void apply(vf (&c)[MR][NV]) const {
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) {
            const vf l2 = simd::load(lse2 + v * W);
            const vi col = simd::iota() + (col0 + v * W);
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) {
                vf s = c[r][v] - l2;
                if constexpr (Masked)
                    s = simd::select((col >= (vi{} + lo[r])) & (col < (vi{} + hi[r])), s,
                                     splat(-simd::kInf));
                c[r][v] = simd::exp2(s);
            }
        }
    }
    ProbabilityEpilogue at(int m, int n) const {
        return {lse2 + n, Masked ? lo + m : lo, Masked ? hi + m : hi, col0 + n};
    }
};

// dS^T = P^T * (dP^T - delta) as dP^T leaves the registers (the softmax
// scale is folded into dO^T and delta beforehand).
struct GradientEpilogue {
    const float* P;  // P^T at this block's first element
    int64_t ldp;
    const float* delta;  // per column

    template <int MR, int NV>
    void apply(vf (&c)[MR][NV]) const {
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) {
            const vf dl = simd::load(delta + v * W);
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) c[r][v] = simd::load(P + r * ldp + v * W) * (c[r][v] - dl);
        }
    }
    GradientEpilogue at(int m, int n) const { return {P + m * ldp + n, ldp, delta + n}; }
};

void chunk_task(const Context& cx, int64_t b, int64_t hk, const Chunk& ch) {
    const FlashParams& p = cx.p;
    const BackwardIO& io = cx.io;
    const Prepared& prep = cx.prep;
    const int D = p.D, Dp = cx.Dp, BQ = prep.BQ;
    const float* k0 = io.k + b * p.k.b + hk * p.k.h;
    const float* v0 = io.v + b * p.v.b + hk * p.v.h;
    float* dk0 = io.dk + b * p.dk.b + hk * p.dk.h;
    float* dv0 = io.dv + b * p.dv.b + hk * p.dv.h;

    float* Kp = scratch(size_t(kBlockK) * Dp, 0);
    float* Vp = scratch(size_t(kBlockK) * Dp, 1);
    float* ST = scratch(size_t(kBlockK) * BQ, 2);
    float* dPT = scratch(size_t(kBlockK) * BQ, 3);
    float* dK = scratch(size_t(kBlockK) * Dp, 6);
    float* dV = scratch(size_t(kBlockK) * Dp, 7);
    int lo[kBlockK], hi[kBlockK];
    for (int j = 0; j < kBlockK; ++j)
        for (int d = D; d < Dp; ++d) Kp[j * Dp + d] = Vp[j * Dp + d] = 0.0f;

    // This task's dQ partial rows, zeroed before accumulating.
    auto partial_of = [&](int64_t h) {
        return cx.partial + ((b * p.H + h) * cx.rows_per_head + ch.offset) * Dp;
    };
    for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h)
        std::memset(partial_of(h), 0, sizeof(float) * size_t(ch.row1 - ch.row0) * Dp);

    for (int64_t kb = ch.kb0; kb < ch.kb1; ++kb) {
        const int64_t j0 = kb * kBlockK;
        const int nk = int(std::min<int64_t>(kBlockK, p.Tk - j0));
        const Range rows = rows_of_keys(p, j0, j0 + nk);
        std::memset(dK, 0, sizeof(float) * size_t(nk) * Dp);
        std::memset(dV, 0, sizeof(float) * size_t(nk) * Dp);
        if (rows.begin < rows.end) {
            for (int j = 0; j < nk; ++j) {
                std::memcpy(Kp + j * Dp, k0 + (j0 + j) * p.k.t, sizeof(float) * D);
                std::memcpy(Vp + j * Dp, v0 + (j0 + j) * p.v.t, sizeof(float) * D);
            }
        }
        for (int64_t h = hk * p.group; rows.begin < rows.end && h < (hk + 1) * p.group; ++h) {
            float* dq_part = partial_of(h);
            for (int64_t qb = rows.begin / BQ; qb * BQ < rows.end; ++qb) {
                const int64_t i0 = qb * BQ;
                const int nq = int(std::min<int64_t>(BQ, p.Tq - i0));
                const size_t at = prep.index(b, h, qb, p.H);
                // S^T = K Q^T and dP^T = V dO^T, both keys x queries.
                // S^T = K Q^T becomes P^T, and dP^T = V dO^T becomes dS^T, as
                // they are computed (keys x queries).
                const float* lse2 = prep.lse2.data() + at * BQ;
                const float* qt = prep.qt.data() + at * prep.tile;
                if (block_inside_band(p, i0, i0 + nq, j0, j0 + nk)) {
                    gemm<false>(nk, BQ, D, Kp, Dp, qt, BQ, ST, BQ, nullptr, false,
                                ProbabilityEpilogue<false>{lse2, lo, hi, 0});
                } else {
                    for (int j = 0; j < nk; ++j) key_columns(p, j0 + j, i0, nq, lo[j], hi[j]);
                    gemm<false>(nk, BQ, D, Kp, Dp, qt, BQ, ST, BQ, nullptr, false,
                                ProbabilityEpilogue<true>{lse2, lo, hi, 0});
                }
                gemm<false>(nk, BQ, D, Vp, Dp, prep.dot.data() + at * prep.tile, BQ, dPT, BQ,
                            nullptr, false,
                            GradientEpilogue{ST, BQ, prep.delta.data() + at * BQ});
                const float* Qr = prep.qr.data() + at * prep.tile;
                const float* dOr = prep.dor.data() + at * prep.tile;
                gemm<false>(nk, Dp, nq, ST, BQ, dOr, Dp, dV, Dp, nullptr, true);   // dV += P^T dO
                gemm<false>(nk, Dp, nq, dPT, BQ, Qr, Dp, dK, Dp, nullptr, true);   // dK += dS^T Q
                gemm<true>(nq, Dp, nk, dPT, BQ, Kp, Dp, dq_part + (i0 - ch.row0) * Dp, Dp,
                           nullptr, true);                                           // dQ += dS K
            }
        }
        for (int j = 0; j < nk; ++j) {
            std::memcpy(dk0 + (j0 + j) * p.dk.t, dK + j * Dp, sizeof(float) * D);
            std::memcpy(dv0 + (j0 + j) * p.dv.t, dV + j * Dp, sizeof(float) * D);
        }
    }
}

}  // namespace

void attention_backward(const FlashParams& p, const BackwardIO& io) {
    Prepared prep;
    prep.BQ = query_block(p, W);
    prep.blocks = int((int64_t(p.Tq) + prep.BQ - 1) / prep.BQ);
    prep.Dp = int(round_up(p.D, W));
    prep.tile = size_t(prep.Dp) * prep.BQ;
    const size_t tiles = size_t(p.B) * p.H * prep.blocks;
    prep.qt.resize(tiles * prep.tile);
    prep.dot.resize(tiles * prep.tile);
    prep.qr.resize(tiles * prep.tile);
    prep.dor.resize(tiles * prep.tile);
    prep.lse2.resize(tiles * prep.BQ);
    prep.delta.resize(tiles * prep.BQ);
    prepare(p, io, prep);

    int64_t rows_per_head = 0;
    const std::vector<Chunk> chunks = plan_chunks(p, prep.BQ, rows_per_head);
    const int Dp = int(round_up(p.D, W));
    AlignedBuffer partial(size_t(p.B) * p.H * size_t(rows_per_head) * Dp);
    const Context cx{p, io, prep, chunks, partial.data(), rows_per_head, Dp};

    const int64_t kv_heads = int64_t(p.B) * p.Hkv;
    const int64_t n_chunks = int64_t(chunks.size());
    parallel_for(kv_heads * n_chunks, [&](int64_t t) {
        const int64_t c = t / kv_heads, bh = t % kv_heads;
        chunk_task(cx, bh / p.Hkv, bh % p.Hkv, chunks[size_t(c)]);
    });

    // dQ = the sum of the partials that cover each row, in chunk order.
    const int64_t heads = int64_t(p.B) * p.H;
    const int BQ = prep.BQ;
    parallel_for(heads * prep.blocks, [&](int64_t t) {
        const int64_t bh = t / prep.blocks, i0 = (t % prep.blocks) * BQ;
        const int nq = int(std::min<int64_t>(BQ, p.Tq - i0));
        float* dq0 = io.dq + (bh / p.H) * p.dq.b + (bh % p.H) * p.dq.h;
        float* acc = scratch(size_t(BQ) * Dp, 0);
        std::memset(acc, 0, sizeof(float) * size_t(nq) * Dp);
        for (const Chunk& ch : chunks) {
            if (i0 < ch.row0 || i0 >= ch.row1) continue;
            const float* src = partial.data() + (bh * rows_per_head + ch.offset + (i0 - ch.row0)) * Dp;
            for (int64_t x = 0; x < int64_t(nq) * Dp; ++x) acc[x] += src[x];
        }
        for (int r = 0; r < nq; ++r)
            std::memcpy(dq0 + (i0 + r) * p.dq.t, acc + r * Dp, sizeof(float) * p.D);
    });
}

}  // namespace flashattn::cpu
