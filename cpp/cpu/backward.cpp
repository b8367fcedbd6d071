// Backward pass of the cpu engine (FlashAttention-2 split, no atomics):
// delta = rowsum(do * o); then dK, dV per (batch, kv head, key block) over the
// query rows of its whole head group, and dQ per (batch, head, query block).
// Probabilities are recomputed from lse, tile by tile.
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/attention.h"
#include "cpu/thread_pool.h"
#include "cpu/tiles.h"

namespace flashattn::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Grads {
    const FlashParams& p;
    const BackwardIO& io;
    const float* delta;  // (B, H, Tq): rowsum(do * o)
};

// P = exp(scale * S - lse) inside the band, 0 outside; dS = P * (dP - delta) * scale.
// S becomes P and dP becomes dS, in place.
void probabilities(const FlashParams& p, int64_t i0, int rows, int64_t j0, int nk, bool full,
                   const float* lse, const float* delta, float* S, float* dP) {
    const float c = p.scale * kLog2e;
    for (int r = 0; r < rows; ++r) {
        float* s = S + r * kBlockK;
        float* dp = dP + r * kBlockK;
        int lo = 0, hi = nk;
        if (!full) row_columns(p, i0 + r, j0, nk, lo, hi);
        if (lse[r] == kNegInf) lo = hi = 0;  // the row sees no key at all
        const float l2 = lse[r] * kLog2e;
        const float dr = delta[r];
        for (int j = 0; j < nk; ++j) {
            const float e = (j >= lo && j < hi) ? std::exp2(s[j] * c - l2) : 0.0f;
            s[j] = e;
            dp[j] = e * (dp[j] - dr) * p.scale;
        }
    }
}

// Loads rows [i0, i0 + rows) of one head of q-shaped `src` into a dense tile.
void load_rows(const float* src, int64_t t_stride, int64_t i0, int rows, int D, float* dst) {
    for (int r = 0; r < rows; ++r) {
        const float* s = src + (i0 + r) * t_stride;
        for (int d = 0; d < D; ++d) dst[r * D + d] = s[d];
    }
}
void load_rows_transposed(const float* src, int64_t t_stride, int64_t j0, int n, int D,
                          float* dst) {
    for (int j = 0; j < n; ++j) {
        const float* s = src + (j0 + j) * t_stride;
        for (int d = 0; d < D; ++d) dst[d * kBlockK + j] = s[d];
    }
}
void clear(float* x, size_t n) {
    for (size_t i = 0; i < n; ++i) x[i] = 0.0f;
}

void dkdv_block(const Grads& g, int64_t b, int64_t hk, int64_t j0, int64_t j1) {
    const FlashParams& p = g.p;
    const BackwardIO& io = g.io;
    const int D = p.D;
    const int nk = int(j1 - j0);
    const float* k0 = io.k + b * p.k.b + hk * p.k.h;
    const float* v0 = io.v + b * p.v.b + hk * p.v.h;

    float* Kt = scratch(size_t(D) * kBlockK, 0);
    float* Vt = scratch(size_t(D) * kBlockK, 1);
    float* Q = scratch(size_t(kBlockQ) * D, 2);
    float* dO = scratch(size_t(kBlockQ) * D, 3);
    float* S = scratch(size_t(kBlockQ) * kBlockK, 4);
    float* dP = scratch(size_t(kBlockQ) * kBlockK, 5);
    float* dK = scratch(size_t(kBlockK) * D, 6);
    float* dV = scratch(size_t(kBlockK) * D, 7);
    load_rows_transposed(k0, p.k.t, j0, nk, D, Kt);
    load_rows_transposed(v0, p.v.t, j0, nk, D, Vt);
    clear(dK, size_t(nk) * D);
    clear(dV, size_t(nk) * D);

    const Range rows_range = rows_of_keys(p, j0, j1);
    for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h) {
        const float* q0 = io.q + b * p.q.b + h * p.q.h;
        const float* do0 = io.dout + b * p.dout.b + h * p.dout.h;
        const float* lse0 = io.lse + (b * p.H + h) * int64_t(p.Tq);
        const float* delta0 = g.delta + (b * p.H + h) * int64_t(p.Tq);
        for (int64_t i0 = rows_range.begin; i0 < rows_range.end; i0 += kBlockQ) {
            const int rows = int(std::min<int64_t>(kBlockQ, rows_range.end - i0));
            load_rows(q0, p.q.t, i0, rows, D, Q);
            load_rows(do0, p.dout.t, i0, rows, D, dO);
            clear(S, size_t(rows) * kBlockK);
            clear(dP, size_t(rows) * kBlockK);
            gemm_acc(rows, nk, D, Q, D, 1, Kt, kBlockK, S, kBlockK);
            gemm_acc(rows, nk, D, dO, D, 1, Vt, kBlockK, dP, kBlockK);
            const bool full = block_inside_band(p, i0, i0 + rows, j0, j1);
            probabilities(p, i0, rows, j0, nk, full, lse0 + i0, delta0 + i0, S, dP);
            gemm_acc(nk, D, rows, S, 1, kBlockK, dO, D, dV, D);  // dV += P^T dO
            gemm_acc(nk, D, rows, dP, 1, kBlockK, Q, D, dK, D);  // dK += dS^T Q
        }
    }
    float* dk0 = io.dk + b * p.dk.b + hk * p.dk.h;
    float* dv0 = io.dv + b * p.dv.b + hk * p.dv.h;
    for (int j = 0; j < nk; ++j)
        for (int d = 0; d < D; ++d) {
            dk0[(j0 + j) * p.dk.t + d] = dK[j * D + d];
            dv0[(j0 + j) * p.dv.t + d] = dV[j * D + d];
        }
}

void dq_block(const Grads& g, int64_t b, int64_t h, int64_t i0, int64_t i1) {
    const FlashParams& p = g.p;
    const BackwardIO& io = g.io;
    const int D = p.D;
    const int rows = int(i1 - i0);
    const int64_t hk = h / p.group;
    const float* k0 = io.k + b * p.k.b + hk * p.k.h;
    const float* v0 = io.v + b * p.v.b + hk * p.v.h;
    const float* lse = io.lse + (b * p.H + h) * int64_t(p.Tq) + i0;
    const float* delta = g.delta + (b * p.H + h) * int64_t(p.Tq) + i0;

    float* Q = scratch(size_t(kBlockQ) * D, 0);
    float* dO = scratch(size_t(kBlockQ) * D, 1);
    float* Kt = scratch(size_t(D) * kBlockK, 2);
    float* Vt = scratch(size_t(D) * kBlockK, 3);
    float* K = scratch(size_t(kBlockK) * D, 4);
    float* S = scratch(size_t(kBlockQ) * kBlockK, 5);
    float* dP = scratch(size_t(kBlockQ) * kBlockK, 6);
    float* dQ = scratch(size_t(kBlockQ) * D, 7);
    load_rows(io.q + b * p.q.b + h * p.q.h, p.q.t, i0, rows, D, Q);
    load_rows(io.dout + b * p.dout.b + h * p.dout.h, p.dout.t, i0, rows, D, dO);
    clear(dQ, size_t(rows) * D);

    const Range keys = keys_of_rows(p, i0, i1);
    for (int64_t j0 = keys.begin; j0 < keys.end; j0 += kBlockK) {
        const int nk = int(std::min<int64_t>(kBlockK, keys.end - j0));
        load_rows_transposed(k0, p.k.t, j0, nk, D, Kt);
        load_rows_transposed(v0, p.v.t, j0, nk, D, Vt);
        load_rows(k0, p.k.t, j0, nk, D, K);
        clear(S, size_t(rows) * kBlockK);
        clear(dP, size_t(rows) * kBlockK);
        gemm_acc(rows, nk, D, Q, D, 1, Kt, kBlockK, S, kBlockK);
        gemm_acc(rows, nk, D, dO, D, 1, Vt, kBlockK, dP, kBlockK);
        const bool full = block_inside_band(p, i0, i1, j0, j0 + nk);
        probabilities(p, i0, rows, j0, nk, full, lse, delta, S, dP);
        gemm_acc(rows, D, nk, dP, kBlockK, 1, K, D, dQ, D);  // dQ += dS K
    }
    float* dq0 = io.dq + b * p.dq.b + h * p.dq.h;
    for (int r = 0; r < rows; ++r)
        for (int d = 0; d < D; ++d) dq0[(i0 + r) * p.dq.t + d] = dQ[r * D + d];
}

}  // namespace

void attention_backward(const FlashParams& p, const BackwardIO& io) {
    const int64_t heads = int64_t(p.B) * p.H;
    const int64_t kv_heads = int64_t(p.B) * p.Hkv;
    const int64_t q_blocks = (int64_t(p.Tq) + kBlockQ - 1) / kBlockQ;
    const int64_t k_blocks = (int64_t(p.Tk) + kBlockK - 1) / kBlockK;
    const int D = p.D;

    std::vector<float> delta(size_t(heads) * p.Tq);
    parallel_for(heads * q_blocks, [&](int64_t t) {
        const int64_t bh = t / q_blocks, b = bh / p.H, h = bh % p.H;
        const int64_t i0 = (t % q_blocks) * kBlockQ;
        const int64_t i1 = std::min<int64_t>(i0 + kBlockQ, p.Tq);
        const float* o0 = io.o + b * p.o.b + h * p.o.h;
        const float* do0 = io.dout + b * p.dout.b + h * p.dout.h;
        for (int64_t i = i0; i < i1; ++i) {
            const float* x = o0 + i * p.o.t;
            const float* y = do0 + i * p.dout.t;
            float acc = 0.0f;
            for (int d = 0; d < D; ++d) acc += x[d] * y[d];
            delta[size_t(bh) * p.Tq + i] = acc;
        }
    });

    const Grads g{p, io, delta.data()};
    // Heaviest blocks first, to even out the threads' finishing times: under
    // a causal mask the first key blocks and the last query blocks see most.
    parallel_for(kv_heads * k_blocks, [&](int64_t t) {
        const int64_t kb = t / kv_heads, bh = t % kv_heads;
        const int64_t j0 = kb * kBlockK;
        dkdv_block(g, bh / p.Hkv, bh % p.Hkv, j0, std::min<int64_t>(j0 + kBlockK, p.Tk));
    });
    parallel_for(heads * q_blocks, [&](int64_t t) {
        const int64_t qb = q_blocks - 1 - t / heads, bh = t % heads;
        const int64_t i0 = qb * kBlockQ;
        dq_block(g, bh / p.H, bh % p.H, i0, std::min<int64_t>(i0 + kBlockQ, p.Tq));
    });
}

}  // namespace flashattn::cpu
