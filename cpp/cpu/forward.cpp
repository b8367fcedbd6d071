// Forward pass of the cpu engine (FlashAttention-2 split): one task per
// (batch, head, block of query rows); each walks the key blocks of its band
// with an online softmax and writes o and lse = log(sum exp(scale * q.k)).
#include <cmath>
#include <limits>

#include "cpu/attention.h"
#include "cpu/thread_pool.h"
#include "cpu/tiles.h"

namespace flashattn::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void forward_block(const FlashParams& p, const ForwardIO& io, int64_t b, int64_t h, int64_t i0,
                   int64_t i1) {
    const int D = p.D;
    const int rows = int(i1 - i0);
    const int64_t hk = h / p.group;
    const float* q0 = io.q + b * p.q.b + h * p.q.h;
    const float* k0 = io.k + b * p.k.b + hk * p.k.h;
    const float* v0 = io.v + b * p.v.b + hk * p.v.h;
    float* o0 = io.o + b * p.o.b + h * p.o.h;
    float* lse0 = io.lse + (b * p.H + h) * int64_t(p.Tq);

    float* Q = scratch(size_t(kBlockQ) * D, 0);
    float* Kt = scratch(size_t(D) * kBlockK, 1);  // transposed: Kt[d, j]
    float* V = scratch(size_t(kBlockK) * D, 2);
    float* S = scratch(size_t(kBlockQ) * kBlockK, 3);
    float* O = scratch(size_t(kBlockQ) * D, 4);
    float m[kBlockQ], l[kBlockQ];

    for (int r = 0; r < rows; ++r) {
        const float* src = q0 + (i0 + r) * p.q.t;
        for (int d = 0; d < D; ++d) Q[r * D + d] = src[d], O[r * D + d] = 0.0f;
        m[r] = kNegInf;  // running max of scale * log2(e) * q.k
        l[r] = 0.0f;
    }
    const float c = p.scale * kLog2e;  // exp(scale * s) = exp2(c * s)

    const Range keys = keys_of_rows(p, i0, i1);
    for (int64_t j0 = keys.begin; j0 < keys.end; j0 += kBlockK) {
        const int nk = int(std::min<int64_t>(kBlockK, keys.end - j0));
        const bool full = block_inside_band(p, i0, i1, j0, j0 + nk);
        for (int j = 0; j < nk; ++j) {
            const float* ks = k0 + (j0 + j) * p.k.t;
            const float* vs = v0 + (j0 + j) * p.v.t;
            for (int d = 0; d < D; ++d) Kt[d * kBlockK + j] = ks[d], V[j * D + d] = vs[d];
        }
        for (int r = 0; r < rows; ++r)
            for (int j = 0; j < nk; ++j) S[r * kBlockK + j] = 0.0f;
        gemm_acc(rows, nk, D, Q, D, 1, Kt, kBlockK, S, kBlockK);

        for (int r = 0; r < rows; ++r) {
            float* s = S + r * kBlockK;
            int lo = 0, hi = nk;
            if (!full) row_columns(p, i0 + r, j0, nk, lo, hi);
            float mx = kNegInf;
            for (int j = lo; j < hi; ++j) mx = std::max(mx, s[j] * c);
            const float m_new = std::max(m[r], mx);
            if (m_new == kNegInf) {  // this row has seen no key yet
                for (int j = 0; j < nk; ++j) s[j] = 0.0f;
                continue;
            }
            const float corr = std::exp2(m[r] - m_new);  // 0 when m was -inf
            float sum = 0.0f;
            for (int j = 0; j < nk; ++j) {
                const float e = (j >= lo && j < hi) ? std::exp2(s[j] * c - m_new) : 0.0f;
                s[j] = e;
                sum += e;
            }
            l[r] = l[r] * corr + sum;
            m[r] = m_new;
            if (corr != 1.0f)
                for (int d = 0; d < D; ++d) O[r * D + d] *= corr;
        }
        gemm_acc(rows, D, nk, S, kBlockK, 1, V, D, O, D);
    }

    for (int r = 0; r < rows; ++r) {
        float* dst = o0 + (i0 + r) * p.o.t;
        if (l[r] > 0.0f) {
            const float inv = 1.0f / l[r];
            for (int d = 0; d < D; ++d) dst[d] = O[r * D + d] * inv;
            lse0[i0 + r] = (m[r] + std::log2(l[r])) * kLn2;
        } else {  // a row that sees no key
            for (int d = 0; d < D; ++d) dst[d] = 0.0f;
            lse0[i0 + r] = kNegInf;
        }
    }
}

}  // namespace

void attention_forward(const FlashParams& p, const ForwardIO& io) {
    const int64_t blocks = (int64_t(p.Tq) + kBlockQ - 1) / kBlockQ;
    const int64_t heads = int64_t(p.B) * p.H;
    // Last query blocks first: under a causal mask they carry the most keys,
    // and starting them early evens out the threads' finishing times.
    parallel_for(heads * blocks, [&](int64_t t) {
        const int64_t qb = blocks - 1 - t / heads;
        const int64_t bh = t % heads;
        const int64_t i0 = qb * kBlockQ;
        forward_block(p, io, bh / p.H, bh % p.H, i0, std::min<int64_t>(i0 + kBlockQ, p.Tq));
    });
}

}  // namespace flashattn::cpu
