// Backward pass of the cpu engine, FlashAttention-2 style and deterministic
// (no atomics): one task per (batch, kv head, chunk of key blocks) walks its
// key blocks (per query head instead when a GQA call has few kv heads: see
// heads_per_task); for each, every query tile of the task's heads that sees it
// recomputes P = exp(scale * S - lse) and dS, accumulates dK and dV for the
// block in scratch, and adds dS K into dQ. The first chunk adds into dq
// itself; later chunks (there are some only when B * Hkv is too small to
// make kTargetTasks tasks) into partials that are summed in chunk order at
// the end. Where those partials would outgrow their budget (long calls with
// few heads), the query rows are taken in bands, one after the other, each
// split into chunks of its own and adding to the dK, dV the bands before it
// left. The split depends on the shape only, so results never depend on
// the thread count.
//
// Tiles are queries x keys. The key block is fixed while the query tiles go
// by, so its operands (K^T and V^T for the scores, K for dQ) are laid out
// once per block; each query tile is gathered, contiguous and zero-padded,
// where it is used: O(BQ * D) copies against O(BQ * BK * D) products. Beyond
// inputs and outputs, a call holds one float per query row, per-thread
// tiles and the partials, which a budget bounds (except that a head size
// that is not a multiple of the vector width, or a float16 / bfloat16 call,
// whose dq is rounded once from float32 sums, sends even the first chunk to
// a float32 partial, as large as dq at most): memory is O(T), never O(T^2).
// Half inputs are converted to float32 as each tile gathers them
// (cpu/convert.h); outputs are rounded to the dtype once, as they are stored.
//
// The scores are recomputed bit for bit as the forward made them (the same
// products, scale * q times k, summed in the same order), so P rows sum to
// what lse says even when the scores are ~1e5 and each carries a rounding
// error far larger than the softmax can absorb; and they stay in natural
// units until lse is subtracted, so s - lse is exact.
#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <type_traits>
#include <vector>

#include "cpu/isa_begin.h"  // opens the per-ISA region
#include "cpu/kernels.h"
#include "cpu/amx.h"
#include "cpu/convert.h"
#include "cpu/gemm.h"
#include "cpu/paired_rows.h"
#include "cpu/thread_pool.h"
#include "cpu/tiles.h"
#include "cpu/score_mods.h"

FLASHATTN_CPU_KERNELS(FLASHATTN_CPU_ISA)

namespace flashattn::cpu::FLASHATTN_CPU_ISA {
namespace {

using simd::splat;
using simd::vi;

// dQ partials of the later chunks may take this much; past it, the query
// rows are taken in bands (below), and past that, fewer chunks.
// FLASHATTN_CPU_PARTIAL_BUDGET (bytes, read once) overrides it: the tests
// make it small, so that small calls take bands too.
double partial_budget_bytes() {
    static const double budget = [] {
        const char* env = std::getenv("FLASHATTN_CPU_PARTIAL_BUDGET");
        const double bytes = env ? std::atof(env) : 0.0;
        return bytes > 0.0 ? bytes : 48.0 * 1024 * 1024;
    }();
    return budget;
}

// The split of each (batch, kv head)'s key blocks into chunks, one task
// each, and the dQ rows each chunk adds to (whole query tiles).
struct Chunk {
    int64_t kb0, kb1;    // key blocks [kb0, kb1)
    int64_t row0, row1;  // query rows [row0, row1), multiples of BQ (row1 may pass Tq)
    int64_t offset;      // rows of the partial before this chunk's, per head; -1: dq itself
};

// One band of query rows [row0, row1) (row0 a multiple of BQ) and its
// chunks. Bands run one after the other; every chunk of a band adds its
// rows' share to the dK, dV that the bands before it left.
struct Band {
    int64_t row0, row1;
    int index;  // 0: the first band, which writes every key's dK and dV
    std::vector<Chunk> chunks;
    int64_t partial_rows = 0;  // per head
    int64_t chunk_rows = 0;    // per head, every chunk's rows (the first one's too)
};

struct BackwardPlan {
    std::vector<Band> bands;
    int64_t partial_rows = 0;  // per head: the most any band needs
};

// The query rows that see some key of key blocks [kb0, kb1).
Range rows_of_key_blocks(const FlashParams& p, int64_t kb0, int64_t kb1) {
    return rows_of_keys(p, kb0 * kBlockK, std::min<int64_t>(kb1 * kBlockK, p.Tk));
}

// Those of them in rows [row0, row1).
Range band_rows_of_key_blocks(const FlashParams& p, int64_t kb0, int64_t kb1, int64_t row0,
                              int64_t row1) {
    const Range r = rows_of_key_blocks(p, kb0, kb1);
    return {std::max(r.begin, row0), std::min(r.end, row1)};
}

// Band [row0, row1)'s key blocks in n_chunks chunks of about equal work.
Band plan_band(const FlashParams& p, int BQ, int Dp, int64_t n_chunks, bool dq_float,
               int64_t row0, int64_t row1, int index) {
    const int64_t kblocks = (int64_t(p.Tk) + kBlockK - 1) / kBlockK;
    // Work of a key block: the query tiles of the band that see it.
    std::vector<int64_t> work(size_t(kblocks), 0);
    int64_t total = 0;
    for (int64_t kb = 0; kb < kblocks; ++kb) {
        const Range r = band_rows_of_key_blocks(p, kb, kb + 1, row0, row1);
        if (r.begin < r.end) work[size_t(kb)] = (r.end - 1) / BQ - r.begin / BQ + 1;
        total += work[size_t(kb)];
    }
    // The first chunk adds into dq in place when its rows have no padding
    // and dq is float32 (a half dq is rounded once, from a float32 partial).
    const bool first_in_place = Dp == p.D && dq_float;
    Band band{row0, row1, index, {}, 0, 0};
    int64_t kb = 0, done = 0;
    for (int64_t c = 0; c < n_chunks && kb < kblocks; ++c) {
        Chunk ch{kb, kb, 0, 0, -1};
        const int64_t target = (total * (c + 1)) / n_chunks;
        while (ch.kb1 < kblocks && (done < target || ch.kb1 == ch.kb0 || c == n_chunks - 1)) {
            done += work[size_t(ch.kb1)];
            ++ch.kb1;
        }
        kb = ch.kb1;
        const Range r = band_rows_of_key_blocks(p, ch.kb0, ch.kb1, row0, row1);
        if (r.begin < r.end) {
            ch.row0 = r.begin / BQ * BQ;
            ch.row1 = round_up(r.end, BQ);
        }
        if (c > 0 || !first_in_place) {
            ch.offset = band.partial_rows;
            band.partial_rows += ch.row1 - ch.row0;
        }
        band.chunk_rows += ch.row1 - ch.row0;
        band.chunks.push_back(ch);
    }
    return band;
}

// Tasks a call aims for, whatever the thread count (results depend on the
// shape alone): four per core of a 16-core machine, so that the causal
// band's unequal tasks and the machine's noise even out among the threads
// (with 16, a 16-thread call left threads idle at its end: issue 36).
constexpr int64_t kTargetTasks = 64;

// Query heads per task: a kv head's whole group, so that each key block is
// laid out once and its dK, dV stay in cache across the group; or, when
// there are too few kv heads to make kTargetTasks (with the tasks of the
// calls sharing the loops: Sharing), the fewest heads (a divisor of the
// group) whose dK, dV partials fit the budget, each task's dK, dV summed
// over the group at the end. Then a GQA call splits like the MHA call of
// the same H (the same dQ partials), instead of cutting each kv head's keys
// into more chunks, each a large share of the call (an MQA backward at
// T = 16k was 3 tasks, at 32k 2; with 2 and 4 heads per task, 12 and 4).
int heads_per_task(const FlashParams& p, Sharing sharing) {
    if (p.group == 1 || int64_t(p.B) * p.Hkv + sharing.other_tasks >= kTargetTasks)
        return p.group;
    for (int heads = 1; heads < p.group; ++heads) {
        const double partial_bytes = 8.0 * p.B * (p.H / heads) * double(p.Tk) * p.D;
        if (p.group % heads == 0 && partial_bytes <= partial_budget_bytes()) return heads;
    }
    return p.group;
}

// Enough chunks to make kTargetTasks tasks of `heads` query heads each (with
// the sharing calls' tasks), in as few bands of query rows as keep each
// band's dQ partials within the budget (a long call takes many: at
// T = 65536 with one head, 4 chunks were all the budget allowed without
// bands, 4 tasks for 16 threads); fewer chunks only where bands of one
// query tile each do not fit either. The budget is held to as if every
// chunk had a partial, so that the split does not depend on the dtype
// (whose dq may take the first chunk in place): a float16 or bfloat16
// call's results are the float32 call's on the same values, rounded
// (tests/cpp/test_cpu_engine.cpp).
BackwardPlan plan_backward(const FlashParams& p, int BQ, int Dp, int heads, bool dq_float,
                           Sharing sharing) {
    const int64_t units = int64_t(p.B) * p.H / heads + sharing.other_tasks;
    const int64_t kblocks = (int64_t(p.Tk) + kBlockK - 1) / kBlockK;
    const int64_t tiles = (int64_t(p.Tq) + BQ - 1) / BQ;
    for (int64_t n = std::min<int64_t>((kTargetTasks + units - 1) / units, kblocks);; --n) {
        n = std::max<int64_t>(n, 1);
        for (int64_t n_bands = 1;; n_bands = std::min(2 * n_bands, tiles)) {
            const int64_t rows = ((tiles + n_bands - 1) / n_bands) * BQ;
            BackwardPlan plan;
            int64_t chunk_rows = 0;
            for (int64_t row0 = 0; row0 < p.Tq; row0 += rows) {
                plan.bands.push_back(plan_band(p, BQ, Dp, n, dq_float, row0,
                                               std::min<int64_t>(row0 + rows, p.Tq),
                                               int(plan.bands.size())));
                plan.partial_rows = std::max(plan.partial_rows, plan.bands.back().partial_rows);
                chunk_rows = std::max(chunk_rows, plan.bands.back().chunk_rows);
            }
            const double bytes = 4.0 * p.B * p.H * double(chunk_rows) * Dp;
            if (n == 1 || bytes <= partial_budget_bytes()) return plan;
            if (n_bands == tiles) break;
        }
    }
}

// Where the score options (score_mods.h) meet a queries x keys tile: row r
// is query query0 + r, lane l of vector v key key0 + v * W + l; the mask
// tile and the softcap's derivative (both laid out like P, row stride ld)
// may be null.
struct TileMods {
    const ScoreMods* mods;  // null: plain attention
    int64_t query0, key0;
    const float* bias;
    float* dcap;
    int64_t ld;

    // Lane l of c[r][v] is key key0 + v W + l against query query0 + r.
    template <int MR, int NV>
    void apply(vf (&c)[MR][NV]) const {
        mods->apply(c, int32_t(key0 - query0 - mods->offset), bias, dcap, ld);
    }
    TileMods at(int m, int n) const {
        return {mods, query0 + m, key0 + n, bias ? bias + m * ld + n : nullptr,
                dcap ? dcap + m * ld + n : nullptr, ld};
    }
};

// P below 2^kMinLog2P (5e-20) is taken as 0. Against the row's total weight
// of 1 float32 cannot see it, and what it would add to a key's dk and dv is
// below 5e-20 times the row's do; kept, dS = P (dP - delta) is often a
// denormal, which costs the dK and dQ products a microcode assist at every
// use (ALiBi's far keys: +10% for the backward on AVX-512).
constexpr float kMinLog2P = -64.0f;

// P = exp(S - lse) inside the band, 0 outside and where the mask hides the
// score, computed as each vector of S (already scaled, then the score
// options applied) leaves the registers.
// Masked: the tile crosses the band's edge, and row r (a query) keeps the
// columns (keys) [lo[r], hi[r]).
template <bool Masked>
struct ProbabilityEpilogue {
    const float* lse;  // per row; +inf for a row whose gradient is zero
    const int* lo;     // per row
    const int* hi;
    int col0;
    TileMods mods;

    template <int MR, int NV>
    void apply(vf (&c)[MR][NV]) const {
        if (mods.mods) mods.apply(c);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const vf l = splat(lse[r]);
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) {
                vf s = (c[r][v] - l) * splat(kLog2e);
                if constexpr (Masked) {
                    const vi col = simd::iota() + (col0 + v * W);
                    s = simd::select(simd::in_range(col, lo[r], hi[r]), s, splat(-simd::kInf));
                }
                // A hidden score stays -inf even when lse is NaN (a row
                // holding a NaN): P = 0, as outside the band.
                if (mods.bias)
                    s = simd::select(c[r][v] == splat(-simd::kInf), c[r][v], s);
                c[r][v] = simd::exp2(s, kMinLog2P);
            }
        }
    }
    ProbabilityEpilogue at(int m, int n) const {
        return {lse + m, lo + m, hi + m, col0 + n, mods.at(m, n)};
    }
};

// dS = P * (dP - delta) as dP leaves the registers, times the softcap's
// derivative (dcap, laid out like P) when there is one; 0 outside the band
// and where the mask hides the key (bias, laid out like P: -inf there),
// even where dP is not finite.
template <bool Masked>
struct GradientEpilogue {
    const float* P;  // P at this block's first element
    int64_t ldp;
    const float* delta;  // per row
    const int* lo;       // per row, as in ProbabilityEpilogue
    const int* hi;
    int col0;
    const float* dcap;  // null: no softcap
    const float* bias;  // null: no mask

    template <int MR, int NV>
    void apply(vf (&c)[MR][NV]) const {
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const vf dl = splat(delta[r]);
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) {
                vf g = simd::load(P + r * ldp + v * W) * (c[r][v] - dl);
                if (dcap) g *= simd::load(dcap + r * ldp + v * W);
                if (bias)
                    g = simd::select(simd::load(bias + r * ldp + v * W) == splat(-simd::kInf), vf{},
                                     g);
                if constexpr (Masked) {
                    const vi col = simd::iota() + (col0 + v * W);
                    g = simd::select(simd::in_range(col, lo[r], hi[r]), g, vf{});
                }
                c[r][v] = g;
            }
        }
    }
    GradientEpilogue at(int m, int n) const {
        return {P + m * ldp + n, ldp, delta + m, lo + m, hi + m, col0 + n,
                dcap ? dcap + m * ldp + n : nullptr, bias ? bias + m * ldp + n : nullptr};
    }
};

// delta = rowsum(dO * O) for every query row and head, (B, H, Tq), summed
// exactly as gemm_over_d sums dP = dO . v (fma chains over the chunks of d
// that d_chunk(D) gives, the chunks' sums added in order, simd::fma as
// there; on AMX, as the tiles sum it): in a saturated
// row, O is bit for bit the v of its one key, and dP - delta must then be
// exactly 0, or dS = P (dP - delta) leaves an error of ulps of dO . v that
// scale * k multiplies into dq and dk.
// W rows at a time, one per lane; task t of row_delta_tasks(p) does
// kDeltaRows rows of one head.
constexpr int64_t kDeltaRows = 256;
int64_t row_delta_tasks(const FlashParams& p) {
    return int64_t(p.B) * p.H * ((int64_t(p.Tq) + kDeltaRows - 1) / kDeltaRows);
}
template <class T>
void row_deltas(const FlashParams& p, const BackwardIO& io, float* delta, int64_t t) {
    const int64_t rows_per_task = kDeltaRows;
    const int64_t tasks_per_head = (int64_t(p.Tq) + rows_per_task - 1) / rows_per_task;
    const int64_t bh = t / tasks_per_head, b = bh / p.H, h = bh % p.H;
    const int64_t i0 = t % tasks_per_head * rows_per_task;
    const int64_t i1 = std::min<int64_t>(i0 + rows_per_task, p.Tq);
    const T* do0 = static_cast<const T*>(io.dout) + b * p.dout.b + h * p.dout.h;
    const T* o0 = static_cast<const T*>(io.o) + b * p.o.b + h * p.o.h;
#if defined(FLASHATTN_CPU_AMX)
    // Where dP = dO V^T comes from AMX (bfloat16), delta is its product of
    // the same rows with O's: the diagonal of dO O^T, 16 rows at a time,
    // each entry the same tile products in the same order as dP's.
    if constexpr (kAmxScores<T>) {
        if (amx_scores<T>(p)) {
            const AmxScope tiles(true);
            alignas(64) PairBits Ov[kMaxD / 2 * 16];
            alignas(64) float C[16 * 16];
            for (int64_t r0 = i0; r0 < i1; r0 += 16) {
                const int n = int(std::min<int64_t>(16, i1 - r0));
                for (int j = 0; j < 16; ++j)
                    for (int i = 0; i < p.D / 2; ++i)
                        Ov[i * 16 + j] = j < n ? pair_at(o0 + (r0 + j) * p.o.t, i) : 0;
                amx_scores_tiles(do0 + r0 * p.dout.t, p.dout.t, n, p.D, Ov, 16, 16, C, 16);
                for (int r = 0; r < n; ++r) delta[bh * p.Tq + r0 + r] = C[r * 16 + r];
            }
            return;
        }
    }
#endif
    // The W rows' dO and O, d-major (lane r: row r0 + r; lanes past the
    // rows 0), are copied out whole before the sums read them as vectors:
    // read back right after its W scalar stores, a vector cannot be
    // forwarded from them and waited for them to reach the cache, at every
    // d (the deltas took 15 % of a 256 x 64 backward on 2 AVX2 cores, 9 %
    // copied out first).
    alignas(64) float a[kMaxD * W], c[kMaxD * W], out[W];
    for (int64_t r0 = i0; r0 < i1; r0 += W) {
        const int n = int(std::min<int64_t>(W, i1 - r0));
        for (int r = 0; r < n; ++r) {
            const T* g = do0 + (r0 + r) * p.dout.t;
            const T* x = o0 + (r0 + r) * p.o.t;
            for (int d = 0; d < p.D; ++d) {
                a[d * W + r] = to_float(g[d]);
                c[d * W + r] = to_float(x[d]);
            }
        }
        for (int r = n; r < W; ++r)
            for (int d = 0; d < p.D; ++d) a[d * W + r] = c[d * W + r] = 0.0f;
        const int kc = d_chunk(p.D);
        vf acc{};
        for (int d0 = 0; d0 < p.D; d0 += kc) {
            vf part{};
            for (int d = d0; d < std::min(d0 + kc, p.D); ++d)
                part = simd::fma(simd::load(a + d * W), simd::load(c + d * W), part);
            acc = d0 == 0 ? part : acc + part;
        }
        simd::store(out, acc);
        for (int r = 0; r < n; ++r) delta[bh * p.Tq + r0 + r] = out[r];
    }
}

struct Context {
    const FlashParams& p;
    const BackwardIO& io;
    const float* delta;  // (B, H, Tq)
    float* partial;      // (B, H, partial_rows, Dp): a band's dQ partials
    int64_t partial_rows;
    int BQ, Dp;
    int heads;           // query heads per task (heads_per_task)
    // Where each task's dK, dV go: null for dk and dv themselves (whole
    // groups; float32, or rounded to T when one band covers every row),
    // else float32 sums per task unit, (2, B, H / heads, Tk, D), each unit's
    // dK then dV, rounded to T (and summed over a group of one-head units)
    // at the end.
    float* dkv_sums;
    const PairedRows& q_pairs;   // on AMX, q and do in pairs for the whole call (or off)
    const PairedRows& do_pairs;
};

// The key block's operands, from keys [j0, j0 + nk): K^T and V^T (D x BK,
// zero columns past nk) for S and dP, and scale * K (nk x Dp, zero-padded)
// for dQ. Rows of T are converted to float32 as they are read. Where the
// scores come from AMX (cpu/amx.h), Kt and Vt hold K's and V's pairs
// instead (D / 2 x BK): S and dP are both products on the tiles.
template <class T>
void lay_out_key_block(const FlashParams& p, const T* k0, const T* v0, int64_t j0, int nk,
                       float* Kt, float* Vt, float* Kp, int Dp) {
    const int D = p.D;
    const bool amx = amx_scores<T>(p);
    if constexpr (kAmxScores<T>) {
        if (amx) {
            PairBits* Kv = reinterpret_cast<PairBits*>(Kt);
            PairBits* Vv = reinterpret_cast<PairBits*>(Vt);
            for (int j = 0; j < kBlockK; ++j) {
                const T* krow = k0 + (j0 + j) * p.k.t;
                const T* vrow = v0 + (j0 + j) * p.v.t;
                for (int i = 0; i < D / 2; ++i) {
                    Kv[i * kBlockK + j] = j < nk ? pair_at(krow, i) : 0;
                    Vv[i * kBlockK + j] = j < nk ? pair_at(vrow, i) : 0;
                }
            }
        }
    }
    float kr[kMaxD], vr[kMaxD];
    for (int j = 0; j < nk; ++j) {
        load_row(kr, k0 + (j0 + j) * p.k.t, D);
        if (!amx) load_row(vr, v0 + (j0 + j) * p.v.t, D);
        for (int d = 0; d < D; ++d) {
            if (!amx) Kt[d * kBlockK + j] = kr[d], Vt[d * kBlockK + j] = vr[d];
            Kp[j * Dp + d] = kr[d] * p.scale;
        }
        for (int d = D; d < Dp; ++d) Kp[j * Dp + d] = 0.0f;
    }
    if (!amx)
        for (int d = 0; d < D; ++d)
            for (int j = nk; j < kBlockK; ++j) Kt[d * kBlockK + j] = Vt[d * kBlockK + j] = 0.0f;
}

// factor * rows [i0, i0 + nq) of one head's q or do, as float32,
// contiguous with Dp columns.
template <class T>
void gather_rows(const T* src, int64_t ld, int64_t i0, int nq, int D, int Dp, float factor,
                 float* dst) {
    for (int r = 0; r < nq; ++r) {
        float* row = dst + r * Dp;
        load_row(row, src + (i0 + r) * ld, D);
        if (factor != 1.0f)
            for (int d = 0; d < D; ++d) row[d] *= factor;
        for (int d = D; d < Dp; ++d) row[d] = 0.0f;
    }
}

// A key block laid out for its query tiles, and its dK, dV accumulators.
struct KeyBlock {
    const float *Kt, *Vt, *Kp;
    int64_t j0;
    int nk;
    bool k_finite;
    float *dK, *dV;
    const BFloat16* Kv = nullptr;  // on AMX: K's rows in pairs (row_pairs), for dQ
};

// P = exp(scale Q K^T - lse) into P and dS = P * (dO V^T - delta) into dS
// (nq x Nk, row stride kBlockK), masked by the per-row key ranges or not.
// S is scale Q times K^T from Qr (scaled rows) and dP = dO V^T from dOr; or,
// where q is not null, q's and dO's bfloat16 rows (ldq, lddo apart) times
// K's and V's pairs (kb.Kt, kb.Vt) on AMX, S then scaled (delta is then
// summed on AMX too: row_deltas).
template <bool Masked>
void probabilities_and_gradients(const KeyBlock& kb, int nq, int Nk, int D, int Dp,
                                 const float* Qr, const BFloat16* q, int64_t ldq, float scale,
                                 const float* dOr, const BFloat16* dO, int64_t lddo,
                                 const float* lse, const float* delta, const int* klo,
                                 const int* khi, const TileMods& mods, float* P, float* dS) {
    const ProbabilityEpilogue<Masked> probabilities{lse, klo, khi, 0, mods};
    const GradientEpilogue<Masked> gradients{P, kBlockK, delta, klo, khi, 0, mods.dcap, mods.bias};
#if defined(FLASHATTN_CPU_AMX)
    if (q) {
        amx_scores_tiles(q, ldq, nq, D, reinterpret_cast<const PairBits*>(kb.Kt), kBlockK, Nk, P,
                         kBlockK);
        apply_epilogue(P, nq, Nk, kBlockK,
                       ScaledEpilogue<ProbabilityEpilogue<Masked>>{scale, probabilities});
        amx_scores_tiles(dO, lddo, nq, D, reinterpret_cast<const PairBits*>(kb.Vt), kBlockK, Nk,
                         dS, kBlockK);
        apply_epilogue(dS, nq, Nk, kBlockK, gradients);
        return;
    }
#endif
    (void)q, (void)ldq, (void)scale, (void)dO, (void)lddo;
    gemm_over_d<false>(nq, Nk, D, Qr, Dp, kb.Kt, kBlockK, P, kBlockK, probabilities);
    gemm_over_d<false>(nq, Nk, D, dOr, Dp, kb.Vt, kBlockK, dS, kBlockK, gradients);
}

// One query tile against the key block: P and dS, then dV += P^T dO,
// dK += dS^T (scale Q) and dQ += dS (scale K). Where the tile crosses the
// band's edge, masked entries are zeros; the products skip them outright
// when the operand they face holds an inf or NaN (0 * inf is NaN).
template <class T>
void query_tile(const Context& cx, const KeyBlock& kb, const ScoreMods& score, int64_t b,
                int64_t h, const T* q0, const T* do0, const float* lse0,
                const float* delta0, int64_t i0, float* dq, int64_t ldq) {
    const FlashParams& p = cx.p;
    const int D = p.D, Dp = cx.Dp, BQ = cx.BQ, nk = kb.nk;
    const int nq = int(std::min<int64_t>(BQ, p.Tq - i0));
    const int Nk = int(round_up(nk, W));  // columns computed; those past nk are never read
    // The score options: the mask as a tile (a tile it hides wholly adds
    // nothing), and the softcap's derivative, both laid out like P.
    TileMods mods{score.active ? &score : nullptr, i0, kb.j0, nullptr, nullptr, kBlockK};
    if (p.score_mods & (FA_SCORE_MASK_BOOL | FA_SCORE_MASK_FLOAT)) {
        float* bias = scratch(size_t(BQ) * kBlockK, 9);
        if (!mask_tile(p, cx.io.score, b, h, i0, nq, kb.j0, nk, false, bias, kBlockK, Nk)) return;
        mods.bias = bias;
    }
    if (p.score_mods & FA_SCORE_SOFTCAP) mods.dcap = scratch(size_t(BQ) * kBlockK, 10);
    float* Qr = scratch(size_t(BQ) * Dp, 3);
    float* dOr = scratch(size_t(BQ) * Dp, 4);
    float* P = scratch(size_t(BQ) * kBlockK, 5);
    float* dS = scratch(size_t(BQ) * kBlockK, 6);
    // q's own rows, where the scores come from AMX (as in the forward); its
    // float32 rows are then needed only by the float32 products below.
    const BFloat16* q_amx = nullptr;
    if constexpr (kAmxScores<T>)
        if (amx_scores<T>(p)) q_amx = q0 + i0 * p.q.t;
    if (!q_amx) {
        gather_rows(q0, p.q.t, i0, nq, D, Dp, p.scale, Qr);  // as the forward scales it
        gather_rows(do0, p.dout.t, i0, nq, D, Dp, 1.0f, dOr);
    }
    const BFloat16* do_amx = nullptr;
    if constexpr (kAmxScores<T>)
        if (q_amx) do_amx = do0 + i0 * p.dout.t;
    float lse[kBlockQ];
    for (int r = 0; r < nq; ++r) {
        // A row with lse = -inf saw no key in the forward: no gradient.
        const float l = lse0[i0 + r];
        lse[r] = l == -simd::kInf ? simd::kInf : l;
    }
    const float* delta = delta0 + i0;
    int klo[kBlockQ], khi[kBlockQ];  // per query row: the keys it sees (masked tiles)
    int qlo[kBlockK], qhi[kBlockK];  // per key: the query rows that see it

    const bool masked = !block_inside_band(p, i0, i0 + nq, kb.j0, kb.j0 + nk);
    // Some row does not see some key of the tile: the band cuts it, or the
    // mask hides an entry (whose dS and P are zeros, as the band's).
    const float* hidden = mods.bias && any_hidden(mods.bias, nq, nk, kBlockK) ? mods.bias : nullptr;
    const bool cut = masked || hidden;
    if (cut) {
        for (int r = 0; r < nq; ++r) row_keys(p, i0 + r, kb.j0, nk, klo[r], khi[r]);
        for (int j = 0; j < nk; ++j) key_columns(p, kb.j0 + j, i0, nq, qlo[j], qhi[j]);
    }
    if (masked) {
        probabilities_and_gradients<true>(kb, nq, Nk, D, Dp, Qr, q_amx, p.q.t, p.scale, dOr,
                                          do_amx, p.dout.t, lse, delta, klo, khi, mods, P, dS);
    } else {
        probabilities_and_gradients<false>(kb, nq, Nk, D, Dp, Qr, q_amx, p.q.t, p.scale, dOr,
                                           do_amx, p.dout.t, lse, delta, klo, khi, mods, P, dS);
    }
#if defined(FLASHATTN_CPU_AMX)
    // On AMX (bfloat16): dV += P^T dO, dK += dS^T (scale q) and
    // dQ += dS (scale K), with P and dS each split into a bfloat16 and the
    // bfloat16 of what that left (two products each): rounded once, as
    // FlashAttention rounds them, the gradients came out up to 3x the
    // float32 yardstick's error, the rule's limit. A masked tile whose rows
    // hold an inf or NaN takes the float32 products below, which keep masked
    // zeros away from them.
    if constexpr (kAmxScores<T>) {
        if (q_amx && (!cut || (kb.k_finite && all_finite(q_amx, nq, D, p.q.t) &&
                                  all_finite(do0 + i0 * p.dout.t, nq, D, p.dout.t)))) {
            const int Qp = int(round_up(nq, 32)), Kp = int(round_up(nk, 32));
            const int keys = int(round_up(nk, 16)), rows = int(round_up(nq, 16));
            BFloat16* At = reinterpret_cast<BFloat16*>(scratch(size_t(kBlockK) * Qp, 11));
            BFloat16* Bq = reinterpret_cast<BFloat16*>(scratch(size_t(Qp) * Dp / 2, 12));
            BFloat16* Ar = reinterpret_cast<BFloat16*>(scratch(size_t(BQ) * Kp, 13));
            BFloat16* At_lo = At + size_t(kBlockK) * Qp;
            BFloat16* Ar_lo = Ar + size_t(BQ) * Kp;
            // do's and q's rows in pairs: the call's, or laid out here.
            auto pairs_of = [&](const PairedRows& all, const BFloat16* rows, int64_t ld) {
                if (const BFloat16* x = all.block(b, h, i0, nq)) return x;
                row_pairs(rows, ld, nq, D, Dp, Qp, Bq);
                return static_cast<const BFloat16*>(Bq);
            };
            transposed_rows(P, kBlockK, nq, nk, keys, Qp, 1.0f, At, At_lo);
            const BFloat16* dO_pairs = pairs_of(cx.do_pairs, do0 + i0 * p.dout.t, p.dout.t);
            amx_accumulate(At, Qp, dO_pairs, keys, Dp, kb.dV, Dp, At_lo);
            transposed_rows(dS, kBlockK, nq, nk, keys, Qp, p.scale, At, At_lo);
            const BFloat16* q_pairs = pairs_of(cx.q_pairs, q_amx, p.q.t);
            amx_accumulate(At, Qp, q_pairs, keys, Dp, kb.dK, Dp, At_lo);
            rounded_rows(dS, kBlockK, nq, nk, rows, Kp, p.scale, Ar, Ar_lo);
            amx_accumulate(Ar, Kp, kb.Kv, rows, Dp, dq, ldq, Ar_lo);
            return;
        }
    }
#endif
    if (q_amx) {
        gather_rows(q0, p.q.t, i0, nq, D, Dp, p.scale, Qr);
        gather_rows(do0, p.dout.t, i0, nq, D, Dp, 1.0f, dOr);
    }
    // Products over the query rows, C (keys x Dp) += A^T B: dV += P^T dO and
    // dK += dS^T Q; ranged where a masked zero of A faces an inf or NaN of B.
    auto over_queries = [&](const float* A, const float* B, float* C) {
        if (cut && !all_finite(B, nq, D, Dp))
            gemm_ranged<true>(nk, Dp, qlo, qhi, A, kBlockK, B, Dp, C, Dp, nullptr, true, hidden, 1,
                              kBlockK);
        else
            gemm<true>(nk, Dp, nq, A, kBlockK, B, Dp, C, Dp, nullptr, true);
    };
    over_queries(P, dOr, kb.dV);
    over_queries(dS, Qr, kb.dK);
    if (cut && !kb.k_finite)  // dQ += dS K, over the keys
        gemm_ranged<false>(nq, Dp, klo, khi, dS, kBlockK, kb.Kp, Dp, dq, ldq, nullptr, true,
                           hidden, kBlockK, 1);
    else
        gemm<false>(nq, Dp, nk, dS, kBlockK, kb.Kp, Dp, dq, ldq, nullptr, true);
}

// Query heads [heads0, heads0 + cx.heads) of batch b against the keys of
// chunk ch, for the query rows of band `band`; their dK, dV are added to
// what the bands before left (the first band starts them at 0) in dk and
// dv, or in the task unit's float32 sums (cx.dkv_sums).
template <class T>
void chunk_task(const Context& cx, int64_t b, int64_t heads0, const Band& band, const Chunk& ch) {
    const FlashParams& p = cx.p;
    const AmxScope tiles(amx_scores<T>(p));
    const BackwardIO& io = cx.io;
    const int D = p.D, Dp = cx.Dp;
    const int64_t hk = heads0 / p.group;
    const T* k0 = static_cast<const T*>(io.k) + b * p.k.b + hk * p.k.h;
    const T* v0 = static_cast<const T*>(io.v) + b * p.v.b + hk * p.v.h;
    // Row j of the task's dK and dV: in its float32 sums, or in dk and dv
    // themselves (rounded to T as they are stored; only a float32 dk and dv
    // are read back, by a later band: BackwardCall sees to that).
    T* dk0 = static_cast<T*>(io.dk) + b * p.dk.b + hk * p.dk.h;
    T* dv0 = static_cast<T*>(io.dv) + b * p.dv.b + hk * p.dv.h;  // (dv's row stride is dk's)
    const size_t unit = size_t(b * (p.H / cx.heads) + heads0 / cx.heads);
    const size_t units = size_t(p.B) * (p.H / cx.heads);
    auto sums_of = [&](size_t which, int64_t j) {
        return cx.dkv_sums + ((which * units + unit) * size_t(p.Tk) + size_t(j)) * D;
    };
    auto load_dkv = [&](int64_t j, float* dK_row, float* dV_row) {
        if (cx.dkv_sums) {
            std::memcpy(dK_row, sums_of(0, j), sizeof(float) * D);
            std::memcpy(dV_row, sums_of(1, j), sizeof(float) * D);
        } else if constexpr (std::is_same_v<T, float>) {
            std::memcpy(dK_row, dk0 + j * p.dk.t, sizeof(float) * D);
            std::memcpy(dV_row, dv0 + j * p.dk.t, sizeof(float) * D);
        }
    };
    auto store_dkv = [&](int64_t j, const float* dK_row, const float* dV_row) {
        if (cx.dkv_sums) {
            std::memcpy(sums_of(0, j), dK_row, sizeof(float) * D);
            std::memcpy(sums_of(1, j), dV_row, sizeof(float) * D);
        } else {
            store_row(dk0 + j * p.dk.t, dK_row, D);
            store_row(dv0 + j * p.dk.t, dV_row, D);
        }
    };

    float* Kt = scratch(size_t(D) * kBlockK, 0);
    float* Vt = scratch(size_t(D) * kBlockK, 1);
    float* Kp = scratch(size_t(kBlockK) * Dp, 2);
    float* dK = scratch(size_t(kBlockK) * Dp, 7);
    float* dV = scratch(size_t(kBlockK) * Dp, 8);

    // Where each head's dQ goes: rows [row0, row1) of dq itself (the band's
    // rows zeroed first, as the other chunks only add), or of this chunk's partial.
    const int64_t heads1 = heads0 + cx.heads;
    // (dq itself only when it is float32: plan_band says so.)
    auto dq_of = [&](int64_t h, int64_t& ld) -> float* {
        if (ch.offset < 0) {
            ld = p.dq.t;
            return static_cast<float*>(io.dq) + b * p.dq.b + h * p.dq.h + ch.row0 * ld;
        }
        ld = Dp;
        return cx.partial + ((b * p.H + h) * cx.partial_rows + ch.offset) * Dp;
    };
    for (int64_t h = heads0; h < heads1; ++h) {
        if (ch.offset < 0) {
            float* dq = static_cast<float*>(io.dq) + b * p.dq.b + h * p.dq.h;
            for (int64_t i = band.row0; i < band.row1; ++i)
                std::memset(dq + i * p.dq.t, 0, sizeof(float) * D);
        } else {
            int64_t ld;
            std::memset(dq_of(h, ld), 0, sizeof(float) * size_t(ch.row1 - ch.row0) * Dp);
        }
    }

    for (int64_t kb = ch.kb0; kb < ch.kb1; ++kb) {
        const int64_t j0 = kb * kBlockK;
        const int nk = int(std::min<int64_t>(kBlockK, p.Tk - j0));
        const Range rows = band_rows_of_key_blocks(p, kb, kb + 1, band.row0, band.row1);
        // The first band writes every key's dK and dV (zeros where no row
        // sees it); the later ones add to those their rows see.
        if (band.index > 0 && rows.begin >= rows.end) continue;
        if (band.index == 0) {
            std::memset(dK, 0, sizeof(float) * size_t(nk) * Dp);
            std::memset(dV, 0, sizeof(float) * size_t(nk) * Dp);
        } else {
            for (int j = 0; j < nk; ++j) {
                load_dkv(j0 + j, dK + j * Dp, dV + j * Dp);
                for (int d = D; d < Dp; ++d) dK[j * Dp + d] = dV[j * Dp + d] = 0.0f;
            }
        }
        if (rows.begin < rows.end) {
            lay_out_key_block(p, k0, v0, j0, nk, Kt, Vt, Kp, Dp);
            KeyBlock block{Kt, Vt, Kp, j0, nk, all_finite(Kp, nk, D, Dp), dK, dV};
#if defined(FLASHATTN_CPU_AMX)
            if constexpr (kAmxScores<T>) {
                if (amx_scores<T>(p)) {
                    const int kp = int(round_up(nk, 32));
                    BFloat16* Kv = reinterpret_cast<BFloat16*>(scratch(size_t(kp) * Dp / 2, 14));
                    row_pairs(k0 + j0 * p.k.t, p.k.t, nk, D, Dp, kp, Kv);
                    block.Kv = Kv;
                }
            }
#endif
            for (int64_t h = heads0; h < heads1; ++h) {
                stop_if_interrupted();  // a block and head: up to Tq query rows
                const int64_t bh = b * p.H + h;
                const ScoreMods score = ScoreMods::of(p, io.score, b, h);
                const T* q0 = static_cast<const T*>(io.q) + b * p.q.b + h * p.q.h;
                const T* do0 = static_cast<const T*>(io.dout) + b * p.dout.b + h * p.dout.h;
                int64_t ldq;
                float* dq = dq_of(h, ldq);
                for (int64_t i0 = rows.begin / cx.BQ * cx.BQ; i0 < rows.end; i0 += cx.BQ) {
                    // The next tile's q and do rows (a head stride apart) while this one computes.
                    if (i0 + cx.BQ < rows.end) {
                        const int next = int(std::min<int64_t>(cx.BQ, p.Tq - i0 - cx.BQ));
                        prefetch_rows(q0 + (i0 + cx.BQ) * p.q.t, next, D, p.q.t);
                        prefetch_rows(do0 + (i0 + cx.BQ) * p.dout.t, next, D, p.dout.t);
                    }
                    query_tile(cx, block, score, b, h, q0, do0, io.lse + bh * p.Tq,
                               cx.delta + bh * p.Tq, i0, dq + (i0 - ch.row0) * ldq, ldq);
                }
            }
        }
        for (int j = 0; j < nk; ++j) store_dkv(j0 + j, dK + j * Dp, dV + j * Dp);
    }
}

// dq's rows of the band = (dq, when the band's first chunk added there,
// else 0) + every partial that covers the row, in chunk order, summed in
// float32 and rounded to T once; task t of partial_sum_tasks(p, BQ, band)
// does one query tile of one head.
int64_t partial_sum_tasks(const FlashParams& p, int BQ, const Band& band) {
    return int64_t(p.B) * p.H * ((band.row1 - band.row0 + BQ - 1) / BQ);
}
template <class T>
void sum_partials(const Context& cx, const Band& band, int64_t t) {
    const FlashParams& p = cx.p;
    const int BQ = cx.BQ, Dp = cx.Dp;
    const bool from_dq = band.chunks[0].offset < 0;
    const int64_t blocks = (band.row1 - band.row0 + BQ - 1) / BQ;
    const int64_t bh = t / blocks, i0 = band.row0 + t % blocks * BQ;
    const int nq = int(std::min<int64_t>(BQ, band.row1 - i0));
    T* dq = static_cast<T*>(cx.io.dq) + (bh / p.H) * p.dq.b + (bh % p.H) * p.dq.h +
            i0 * p.dq.t;
    float* sum = scratch(size_t(p.D), 0);
    for (int r = 0; r < nq; ++r) {
        // from_dq: the first chunk added into dq itself (then T is float).
        if (from_dq)
            std::memcpy(sum, reinterpret_cast<const float*>(dq + r * p.dq.t),
                        sizeof(float) * p.D);
        else
            std::memset(sum, 0, sizeof(float) * p.D);
        for (const Chunk& ch : band.chunks) {
            if (ch.offset < 0 || i0 < ch.row0 || i0 >= ch.row1) continue;
            const int64_t row = bh * cx.partial_rows + ch.offset + (i0 - ch.row0) + r;
            const float* add = cx.partial + row * Dp;
            for (int d = 0; d < p.D; ++d) sum[d] += add[d];
        }
        store_row(dq + r * p.dq.t, sum, p.D);
    }
}

// dk, dv of each kv head = the sum of its task units' float32 sums (one
// unit, or one per query head of its group), in head order, rounded to T
// once; task t of dkv_sum_tasks(p) does kDkvSumRows keys of one kv head.
constexpr int64_t kDkvSumRows = 256;
int64_t dkv_sum_tasks(const FlashParams& p) {
    return int64_t(p.B) * p.Hkv * ((int64_t(p.Tk) + kDkvSumRows - 1) / kDkvSumRows);
}
template <class T>
void sum_dkv(const Context& cx, int64_t t) {
    const FlashParams& p = cx.p;
    const int D = p.D;
    const int64_t rows_per_task = kDkvSumRows;
    const int64_t tasks_per_head = (int64_t(p.Tk) + rows_per_task - 1) / rows_per_task;
    const int64_t per_kv_head = p.group / cx.heads;
    const size_t units = size_t(p.B) * (p.H / cx.heads);
    const int64_t bk = t / tasks_per_head, b = bk / p.Hkv, hk = bk % p.Hkv;
    const int64_t j0 = t % tasks_per_head * rows_per_task;
    const int64_t j1 = std::min<int64_t>(j0 + rows_per_task, p.Tk);
    for (size_t which = 0; which < 2; ++which) {
        T* out = static_cast<T*>(which == 0 ? cx.io.dk : cx.io.dv) +
                 (which == 0 ? b * p.dk.b + hk * p.dk.h : b * p.dv.b + hk * p.dv.h);
        const float* part =
            cx.dkv_sums +
            (which * units + size_t(b * (p.H / cx.heads) + hk * per_kv_head)) * size_t(p.Tk) * D;
        float* sum = scratch(size_t(D), 0);
        for (int64_t j = j0; j < j1; ++j) {
            std::memcpy(sum, part + j * D, sizeof(float) * D);
            for (int64_t g = 1; g < per_kv_head; ++g) {
                const float* add = part + (size_t(g) * p.Tk + size_t(j)) * D;
                for (int d = 0; d < D; ++d) sum[d] += add[d];
            }
            store_row(out + j * p.dk.t, sum, D);
        }
    }
}

// One call's work (cpu/call_phases.h): phase 0 the row deltas; then per
// band of query rows, the key chunks of every (batch, kv head or query
// head), and the sums of the dQ partials they left, if any; last the sums
// of the float32 dK, dV, if any (with the last band's dQ sums when it has
// some).
template <class T>
class BackwardCall final : public CallPhases {
public:
    BackwardCall(const FlashParams& call, const BackwardIO& call_io, Sharing sharing)
        : p(call), io(call_io), BQ(query_block(p.Tq, W)), Dp(int(round_up(p.D, W))),
          delta(size_t(p.B) * p.H * size_t(p.Tq)), heads(heads_per_task(p, sharing)),
          plan(plan_backward(p, BQ, Dp, heads, std::is_same_v<T, float>, sharing)),
          partial(size_t(p.B) * p.H * size_t(plan.partial_rows) * Dp) {
        // dK, dV are summed in float32 apart from dk and dv where one task
        // unit is not a whole group (summed over the group at the end), or
        // where bands add to what earlier bands left and T is a half type.
        if (heads < p.group || (!std::is_same_v<T, float> && plan.bands.size() > 1))
            dkv_sums.resize(2 * size_t(p.B) * (p.H / heads) * size_t(p.Tk) * p.D);
        // q and do in pairs where each query tile meets several key blocks.
        if (amx_scores<T>(p) && p.Tk > kBlockK) {
            q_pairs = PairedRows(std::in_place_type<T>, io.q, p.q, p.B, p.H, p.Tq, p.D);
            do_pairs = PairedRows(std::in_place_type<T>, io.dout, p.dout, p.B, p.H, p.Tq, p.D);
        }
        units = int64_t(p.B) * p.H / heads;
        const int64_t dkv = dkv_sums.data() ? dkv_sum_tasks(p) : 0;
        steps.push_back({Step::kDeltas, nullptr, row_delta_tasks(p), 0});
        for (const Band& band : plan.bands) {
            steps.push_back({Step::kChunks, &band, units * int64_t(band.chunks.size()), 0});
            if (band.partial_rows > 0)
                steps.push_back({Step::kSums, &band, partial_sum_tasks(p, BQ, band), 0});
        }
        if (dkv > 0) {
            if (steps.back().kind != Step::kSums) steps.push_back({Step::kSums, nullptr, 0, 0});
            steps.back().dkv_tasks = dkv;
        }
    }

    int phases() const override { return int(steps.size()); }
    int64_t tasks(int phase) const override {
        const Step& s = steps[size_t(phase)];
        return s.tasks + s.dkv_tasks;
    }
    void run(int phase, int64_t t) override {
        const Step& s = steps[size_t(phase)];
        if (s.kind == Step::kDeltas) {
            row_deltas<T>(p, io, delta.data(), t);
        } else if (s.kind == Step::kChunks) {
            const int64_t c = t / units, u = t % units;
            const int64_t per_batch = p.H / heads;
            chunk_task<T>(context(), u / per_batch, u % per_batch * heads, *s.band,
                          s.band->chunks[size_t(c)]);
        } else if (t < s.tasks) {
            sum_partials<T>(context(), *s.band, t);
        } else {
            sum_dkv<T>(context(), t - s.tasks);
        }
    }

private:
    Context context() const {
        return Context{p,  io, delta.data(), partial.data(), plan.partial_rows, BQ,
                       Dp, heads, dkv_sums.data(), q_pairs, do_pairs};
    }

    // A phase: the row deltas, a band's chunks, or sums (a band's dQ
    // partials, tasks of them, then dkv_tasks of the dK, dV sums).
    struct Step {
        enum Kind { kDeltas, kChunks, kSums } kind;
        const Band* band;
        int64_t tasks, dkv_tasks;
    };

    const FlashParams p;
    const BackwardIO io;
    const int BQ, Dp;
    AlignedBuffer delta;
    const int heads;
    const BackwardPlan plan;
    AlignedBuffer partial, dkv_sums;
    PairedRows q_pairs, do_pairs;
    int64_t units = 0;
    std::vector<Step> steps;
};

}  // namespace

std::unique_ptr<CallPhases> backward_phases(const FlashParams& p, const BackwardIO& io,
                                            Sharing sharing) {
    std::unique_ptr<CallPhases> call;
    with_element_type(io.dtype, [&](auto element) {
        call = std::make_unique<BackwardCall<decltype(element)>>(p, io, sharing);
    });
    return call;
}

void attention_backward(const FlashParams& p, const BackwardIO& io) {
    run_phases(*FLASHATTN_CPU_ISA::backward_phases(p, io, Sharing{}));
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA

#include "cpu/isa_end.h"
