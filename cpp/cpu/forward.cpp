// Forward pass of the cpu engine (FlashAttention-2 split): one task per
// (batch, kv head, block of query rows, its group's query heads packed in:
// tiles.h); each walks the key blocks of its band with an online softmax and
// writes o and lse = log(sum exp(scale * q.k)). Decoding tasks carry the
// tiles of several kv heads through the keys together, tasks of half inputs
// several query tiles of one kv head (each key block converted once for all
// of them), and calls with few tasks also split the keys (split-KV, below).
//
// Tiles are held transposed, keys x queries, so the queries of a tile run
// along the vector lanes: the softmax statistics (max, sum, rescale) of W
// rows are one vector and need no horizontal reductions, and K is read in
// place as the broadcast operand of S^T = K Q^T.
//
// Once every row of a tile has a running max m, a key block takes a
// one-pass path: exponentials against the (possibly stale) m in one pass
// over S^T, and m is kept unless some score exceeds it by more than
// kHeadroom (then the block is redone the two-pass way). Probabilities up to
// e^kHeadroom relative to m lose no accuracy in float, and skipping the
// rescale saves a pass over the tile and over O.
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
#include "cpu/merge.h"
#include "cpu/paired_rows.h"
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
        // Lane l of c[r][v] is query query0 + v W + l against key key0 + r.
        if (mods) mods->apply(c, int32_t(query0 + mods->offset - key0), bias, nullptr, ld);
    }
    ModsEpilogue at(int m, int n) const {
        return {mods, key0 + m, query0 + n, bias ? bias + m * ld + n : nullptr, ld};
    }
};

// Key j's scores in the tile columns col (lanes), -inf outside the band:
// key j is seen by the columns [lo[j], hi[j]) only (lo null: by all).
inline vf in_band(vf s, vi col, const int* lo, const int* hi, int j) {
    return lo ? simd::select(simd::in_range(col, lo[j], hi[j]), s, splat(-simd::kInf)) : s;
}

// Key j of exponentiate's column vector c (lanes col): exp(S^T - ref) in
// place, its score's max folded into mx and its exponential into sum.
inline void exponentiate_key(float* ST, int BQ, int c, vi col, const int* lo, const int* hi,
                             int j, vf ref, vf& mx, vf& sum) {
    const vf s = in_band(simd::load(ST + j * BQ + c), col, lo, hi, j);
    mx = simd::max(mx, s);
    // Exponents above kHeadroom * log2(e) make the block stale (it is
    // redone, these values dropped): exp2_upto127 suffices.
    const vf e = simd::exp2_upto127((s - ref) * splat(kLog2e));
    sum += e;
    simd::store(ST + j * BQ + c, e);
}

// The one-pass step's exponentials, every row having a running max m: the
// scores S^T (nk x BQ, already scaled) become exp(S^T - m) in place, masked
// to the band as online_softmax masks them, with each column's max score
// in colmax (the caller redoes the block if it exceeds m by more than
// kHeadroom) and its sum of exponentials in colsum. A pass of its own,
// two keys at a time, rather than an epilogue of the score product: there
// the exponentials of each register block waited on its last FMAs and
// stalled the next block's (bfloat16 T = 1024 full forward 2.5 % faster this
// way on 2026-12-06's Zen 3).
void exponentiate(float* ST, int nk, int BQ, const int* lo, const int* hi, const float* m,
                  float* colmax, float* colsum) {
    for (int c = 0; c < BQ; c += W) {
        const vi col = simd::iota() + c;
        const vf ref = simd::load(m + c);
        vf mx0 = splat(-simd::kInf), mx1 = mx0, sum0{}, sum1{};
        int j = 0;
        for (; j + 2 <= nk; j += 2) {  // two independent chains of max and sum
            exponentiate_key(ST, BQ, c, col, lo, hi, j, ref, mx0, sum0);
            exponentiate_key(ST, BQ, c, col, lo, hi, j + 1, ref, mx1, sum1);
        }
        if (j < nk) exponentiate_key(ST, BQ, c, col, lo, hi, j, ref, mx0, sum0);
        simd::store(colmax + c, simd::max(mx0, mx1));
        simd::store(colsum + c, sum0 + sum1);
    }
}

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
                const vf s = in_band(simd::load(ST + j * BQ + c), col, lo, hi, j);
                simd::store(ST + j * BQ + c, s);
                mx = simd::max(mx, s);
            }
        }
        const vf m_old = simd::load(m + c);
        const vf m_new = simd::max(m_old, mx);
        // A row that has seen no key yet keeps m = -inf; exponents use 0 so
        // that -inf - -inf never happens.
        const vf m_use = simd::select(m_new == neg_inf, vf{}, m_new);
        // Every exponent is at most 0 (or NaN): exp2_upto127 suffices.
        const vf rescale = simd::exp2_upto127((m_old - m_use) * splat(kLog2e));
        vf sum{};
        for (int j = 0; j < nk; ++j) {
            const vf e = simd::exp2_upto127((simd::load(ST + j * BQ + c) - m_use) * splat(kLog2e));
            simd::store(ST + j * BQ + c, e);
            sum += e;
        }
        simd::store(l + c, simd::fma(simd::load(l + c), rescale, sum));
        simd::store(m + c, m_new);
        simd::store(corr + c, rescale);
    }
}

// Where a tile's results go: o and lse themselves, or (split-KV) a partial
// o (row r at o + r * D, normalised) and lse per row, merged later.
struct TileOutput {
    float* o = nullptr;  // nullptr: the call's o and lse
    float* lse = nullptr;
};

// A tile of query rows: rows [R0, R0 + nq) of batch b's query heads from
// head0 (packed as TileState says).
struct QueryTile {
    int64_t b, head0, R0;
    int nq;
};

// The K and V rows of keys [j0, j0 + nk) of one kv head as the float32
// operands of a step: float32 rows in place (V only when D needs no
// padding), half rows converted once, on first use, into per-thread tiles
// that every query tile stepping through the block then shares (a task
// carrying several query tiles of a head pays one conversion per block, not
// one per tile). AMX reads bfloat16 rows itself: prepare() then leaves K and
// V null, and the step converts V where it needs float32 rows.
template <class T>
class KeyBlock {
public:
    KeyBlock(const FlashParams& p, const T* k_rows, const T* v_rows, int nk, bool amx)
        : p_(p), k_rows_(k_rows), v_rows_(v_rows), nk_(nk), amx_(amx) {}
    // Rows converted elsewhere (K: ldk apart; V: ldv apart, zero-padded).
    KeyBlock(const FlashParams& p, const float* K_rows, int64_t ldk_rows, const float* V_rows,
             int64_t ldv_rows)
        : K(K_rows), ldk(ldk_rows), V(V_rows), ldv(ldv_rows), p_(p), k_rows_(nullptr),
          v_rows_(nullptr), nk_(0), amx_(false), ready_(true) {}

    void prepare() {
        if (ready_) return;
        ready_ = true;
        if (amx_) return;
        const int D = p_.D, Dp = int(round_up(D, W)), nk = nk_;
        if constexpr (std::is_same_v<T, float>) {
            K = k_rows_, ldk = p_.k.t;
            if (D == Dp) {
                V = v_rows_, ldv = p_.v.t;
                return;
            }
        } else {
            float* Kc = scratch(size_t(kBlockK) * D, 11);
            for (int j = 0; j < nk; ++j) load_row(Kc + j * D, k_rows_ + j * p_.k.t, D);
            K = Kc, ldk = D;
        }
        float* Vp = scratch(size_t(kBlockK) * Dp, 1);  // keys x Dp, zero-padded
        for (int j = 0; j < nk; ++j) {
            load_row(Vp + j * Dp, v_rows_ + j * p_.v.t, D);
            for (int d = D; d < Dp; ++d) Vp[j * Dp + d] = 0.0f;
        }
        V = Vp, ldv = Dp;
    }

    const float* K = nullptr;
    int64_t ldk = 0;
    const float* V = nullptr;
    int64_t ldv = 0;

private:
    const FlashParams& p_;
    const T* const k_rows_;
    const T* const v_rows_;
    const int nk_;
    const bool amx_;
    bool ready_ = false;
};

// One tile: rows [R0, R0 + nq) of the query heads head0 .. head0 + g - 1
// of batch b, packed (tiles.h: row R is position R / g of head
// head0 + R % g; g = p.group packs a kv head's whole group, g = 1 is one
// head's rows), as it walks key blocks: its scaled queries, running max,
// sum and output live in `state` (state_floats of it), so one task may carry
// several tiles through the same keys (decoding, below). Keys outside a
// row's band are masked. Score options need g = 1 (their values are per
// head). The head's sink, if any, is counted where with_sink says (one
// split-KV part only). T is the inputs' element type: float32 rows are read
// in place, float16 and bfloat16 ones converted a key block at a time into
// float32 tiles, except that bfloat16 scores may come from AMX tiles
// (cpu/amx.h; then the state holds q's pairs where Q^T would be).
template <class T>
class TileState {
public:
    static size_t state_floats(const FlashParams& p, int BQ) {
        return size_t(p.D) * BQ + size_t(BQ) * round_up(p.D, W) + 2 * size_t(BQ);
    }

    TileState(const FlashParams& p, const ForwardIO& io, int64_t b, int64_t head0, int g,
              int64_t R0, int nq, int BQ, bool with_sink, float* state,
              const PairedRows* v_pairs = nullptr)
        : p_(p), io_(io), b_(b), head0_(head0), g_(g), R0_(R0), nq_(nq), BQ_(BQ),
          Dp_(int(round_up(p.D, W))),
          k0_(static_cast<const T*>(io.k) + b * p.k.b + head0 / p.group * p.k.h),
          v0_(static_cast<const T*>(io.v) + b * p.v.b + head0 / p.group * p.v.h),
          Qt_(state), O_(Qt_ + size_t(p.D) * BQ), m_(O_ + size_t(BQ) * Dp_), l_(m_ + BQ),
          mods_(ScoreMods::of(p, io.score, b, head0)),
          masked_(p.score_mods & (FA_SCORE_MASK_BOOL | FA_SCORE_MASK_FLOAT)),
          sink_(io.score.sinks && with_sink ? io.score.sinks[head0] : -simd::kInf),
          amx_(amx_scores<T>(p)), v_pairs_(v_pairs) {
        const int D = p.D;
        const T* q0 = static_cast<const T*>(io.q) + b * p.q.b;
        if constexpr (kAmxScores<T>) {
            if (amx_) {  // q's pairs, D / 2 x BQ, in place of Q^T
                PairBits* Qv = reinterpret_cast<PairBits*>(Qt_);
                for (int r = 0; r < BQ; ++r) {
                    const int64_t R = R0 + r, t = R / g, h = head0 + R % g;
                    const T* row = q0 + h * p.q.h + t * p.q.t;
                    for (int i = 0; i < D / 2; ++i) Qv[i * BQ + r] = r < nq ? pair_at(row, i) : 0;
                }
            }
        }
        if (!amx_) load_queries(q0, D);
        std::memset(O_, 0, sizeof(float) * size_t(BQ) * Dp_);
        // A sink is one more logit, with a zero value: it starts the running
        // max and sum (a sink of -inf, or none, starts them empty).
        for (int r = 0; r < BQ; ++r) m_[r] = sink_, l_[r] = sink_ == -simd::kInf ? 0.0f : 1.0f;
    }

    bool alibi() const { return mods_.alibi; }

    // The operands of keys [j0, j0 + nk) of this tile's kv head, for step.
    KeyBlock<T> key_block(int64_t j0, int nk) const {
        return KeyBlock<T>(p_, k0_ + j0 * p_.k.t, v0_ + j0 * p_.v.t, nk, amx_);
    }

    // Folds keys [j0, j0 + nk) into the state; kb is key_block(j0, nk) of
    // this tile or of another tile of the same kv head.
    void step(int64_t j0, int nk, KeyBlock<T>& kb) {
        const int D = p_.D, Dp = Dp_, BQ = BQ_, nq = nq_, g = g_;
        const int64_t R0 = R0_, i0 = R0_;  // i0: the first row, where g == 1 (score options)
        float* ST = scratch(size_t(kBlockK) * BQ, 2);  // keys x queries
        float* corr = scratch(size_t(BQ), 6);
        float* colmax = scratch(size_t(BQ), 7);
        float* colsum = scratch(size_t(BQ), 8);
        float* bias = masked_ ? scratch(size_t(kBlockK) * BQ, 10) : nullptr;  // the mask tile
        int lo[kBlockK], hi[kBlockK];
        if (masked_ &&
            !mask_tile(p_, io_.score, b_, head0_, i0, nq, j0, nk, true, bias, BQ, BQ))
            return;  // the mask hides every score of this block
        const ModsEpilogue mod{mods_.active ? &mods_ : nullptr, j0, i0, bias, BQ};
        const bool full = block_inside_band(p_, R0, R0 + nq, j0, j0 + nk, g);
        // Some row does not see some key of the block: the band cuts it, or
        // the mask hides an entry (the mask tile is keys x queries, -inf
        // there): an inf or NaN in V must stay out of those rows.
        const float* hidden = bias && any_hidden(bias, nk, nq, BQ) ? bias : nullptr;
        const bool cut = !full || hidden;
        // K rows are the broadcast operand of S^T = K Q^T, V rows the B
        // operand of P V (KeyBlock). AMX reads bfloat16 K and V rows as they
        // are (V unless a cut block meets an inf or NaN in it: that takes
        // the ranged float32 product below).
        kb.prepare();
        bool amx_pv = false;
        if constexpr (kAmxScores<T>)
            amx_pv = amx_ && (!cut || all_finite(v0_ + j0 * p_.v.t, nk, D, p_.v.t));
        const float* Vb = kb.V;
        int64_t ldv = kb.ldv;
        const float* Kb = kb.K;
        const int64_t ldk = kb.ldk;
        if (!amx_pv && !Vb) {
            float* Vp = scratch(size_t(kBlockK) * Dp, 1);  // keys x Dp, zero-padded
            for (int j = 0; j < nk; ++j) {
                load_row(Vp + j * Dp, v0_ + (j0 + j) * p_.v.t, D);
                for (int d = D; d < Dp; ++d) Vp[j * Dp + d] = 0.0f;
            }
            Vb = Vp, ldv = Dp;
        }
        // A block the band cuts: the query columns [lo[j], hi[j]) that see
        // key j0 + j, and the keys [klo[r], khi[r]) of the block that row r
        // sees. Its masked P entries are zeros, and 0 times an inf or NaN in
        // V would reach a row that does not see it: with such values in V
        // the P V product takes each row's own keys only (gemm_ranged).
        int klo[kBlockQ], khi[kBlockQ];
        bool v_finite = true;
        if (cut) {
            for (int j = 0; j < nk; ++j) key_columns(p_, j0 + j, R0, nq, lo[j], hi[j], g);
            for (int r = 0; r < nq; ++r) row_keys(p_, R0 + r, j0, nk, klo[r], khi[r], g);
            v_finite = amx_pv || all_finite(Vb, nk, D, ldv);
        }
        const int* band_lo = full ? nullptr : lo;
        const int* band_hi = full ? nullptr : hi;
        // One pass once every row has a max (on AMX for blocks inside the band only).
        if (have_max_ && v_finite && (full || !amx_)) {
            scores(j0, nk, Kb, ldk, ST, mod, band_lo, band_hi);
            exponentiate(ST, nk, BQ, band_lo, band_hi, m_, colmax, colsum);
            bool stale = false;
            for (int r = 0; r < nq; ++r) stale |= colmax[r] > m_[r] + kHeadroom;
            if (!stale) {
                for (int col = 0; col < BQ; col += W)
                    simd::store(l_ + col, simd::load(l_ + col) + simd::load(colsum + col));
                accumulate_pv(j0, nk, ST, Vb, ldv, nullptr, amx_pv, full ? nullptr : klo, khi);
                return;
            }
        }
        // The two-pass step: S^T = K Q^T, then max, rescale and exponentials.
        scores(j0, nk, Kb, ldk, ST, mod, band_lo, band_hi);
        online_softmax(ST, nk, BQ, full, lo, hi, m_, l_, corr);
        // O = O * corr + P V, with P = (S^T)^T.
        if (v_finite)
            accumulate_pv(j0, nk, ST, Vb, ldv, corr, amx_pv, full ? nullptr : klo, khi);
        else
            gemm_ranged<true>(nq, Dp, klo, khi, ST, BQ, Vb, ldv, O_, Dp, corr, true, hidden, 1, BQ);
        have_max_ = true;
        for (int r = 0; r < nq; ++r) have_max_ &= m_[r] != -simd::kInf;
    }

    // S^T = K Q^T, scaled, for keys [j0, j0 + nk) into ST, epi applied as
    // each vector leaves the registers: from float32 K rows (Kb), or on AMX.
    // With a band (key j seen by the query columns [lo[j], hi[j]) only), the
    // keys no column of a chunk of the tile sees are not multiplied: their
    // entries of the chunk are -inf, as the band makes them anyway.
    template <class Epi>
    void scores(int64_t j0, int nk, const float* Kb, int64_t ldk, float* ST, const Epi& epi,
                const int* lo, const int* hi) const {
#if defined(FLASHATTN_CPU_AMX)
        if constexpr (kAmxScores<T>) {
            if (amx_) {
                amx_scores_tiles(k0_ + j0 * p_.k.t, p_.k.t, nk, p_.D,
                                 reinterpret_cast<const PairBits*>(Qt_), BQ_, BQ_, ST, BQ_);
                apply_epilogue(ST, nk, BQ_, BQ_, ScaledEpilogue<Epi>{p_.scale, epi});
                return;
            }
        }
#endif
        (void)j0;
        if (!lo) {
            gemm_over_d<false>(nk, BQ_, p_.D, Kb, ldk, Qt_, BQ_, ST, BQ_, epi);
            return;
        }
        // Column chunks as gemm would take them; the keys some column of a
        // chunk sees form one run (bands are monotone), [k0, k1).
        constexpr int kChunk = kMaxNV * W;
        for (int c0 = 0; c0 < BQ_; c0 += kChunk) {
            const int c1 = std::min(BQ_, c0 + kChunk);
            int k0 = nk, k1 = 0;
            for (int j = 0; j < nk; ++j)
                if (lo[j] < std::min(c1, hi[j]) && hi[j] > c0)
                    k0 = std::min(k0, j), k1 = j + 1;
            if (k1 < k0) k0 = k1 = nk;
            for (int j = 0; j < nk; ++j) {
                if (j == k0) j = k1;
                if (j >= nk) break;
                for (int c = c0; c < c1; c += W)
                    simd::store(ST + j * BQ_ + c, splat(-simd::kInf));
            }
            gemm_over_d<false>(k1 - k0, c1 - c0, p_.D, Kb + k0 * ldk, ldk, Qt_ + c0, BQ_,
                               ST + k0 * BQ_ + c0, BQ_, epi.at(k0, c0));
        }
    }

    // O = O * corr (per row; null: 1) + P V, P = (S^T)^T for keys [j0, j0 + nk):
    // from V's float32 rows (Vb), or on AMX from V's own rows (amx).
    // klo, khi (null inside the band): the keys of the block each row sees;
    // P is zero outside them.
    void accumulate_pv(int64_t j0, int nk, const float* ST, const float* Vb, int64_t ldv,
                       const float* corr, bool amx, const int* klo, const int* khi) {
#if defined(FLASHATTN_CPU_AMX)
        if constexpr (kAmxScores<T>) {
            if (amx) {
                const int Kp = int(round_up(nk, 32)), BQ = BQ_, Dp = Dp_;
                BFloat16* P = reinterpret_cast<BFloat16*>(scratch(size_t(BQ) * Kp / 2, 11));
                transposed_rows(ST, BQ, nk, nq_, BQ, Kp, 1.0f, P);
                const BFloat16* Vv = nullptr;
                if (v_pairs_) Vv = v_pairs_->block(b_, head0_ / p_.group, j0, nk);
                if (!Vv) {
                    BFloat16* pairs =
                        reinterpret_cast<BFloat16*>(scratch(size_t(Kp) * Dp / 2 + 16, 12));
                    row_pairs(v0_ + j0 * p_.v.t, p_.v.t, nk, p_.D, Dp, Kp, pairs);
                    Vv = pairs;
                }
                if (corr)
                    for (int r = 0; r < nq_; ++r)
                        for (int d = 0; d < Dp; d += W)
                            simd::store(O_ + r * Dp + d, simd::load(O_ + r * Dp + d) * splat(corr[r]));
                amx_accumulate(P, Kp, Vv, BQ, Dp, O_, Dp);
                return;
            }
        }
#endif
        (void)j0, (void)amx;
        gemm<true>(nq_, Dp_, nk, ST, BQ_, Vb, ldv, O_, Dp_, corr, true, Identity{}, klo, khi);
    }

    // Asks for keys [j0, j0 + nk)'s K and V rows to come into cache.
    void prefetch(int64_t j0, int nk) const {
        prefetch_rows(k0_ + j0 * p_.k.t, nk, p_.D, p_.k.t);
        prefetch_rows(v0_ + j0 * p_.v.t, nk, p_.D, p_.v.t);
    }

    // The call's o is rounded to T here, once; a split-KV part stays float32
    // until the merge.
    void finish(const TileOutput& out) {
        const int D = p_.D;
        for (int r = 0; r < nq_; ++r) {
            const int64_t R = R0_ + r, t = R / g_, h = head0_ + R % g_;
            float* lse = out.o ? out.lse + r : io_.lse + (b_ * p_.H + h) * int64_t(p_.Tq) + t;
            // Geometry, and then l, decide: a NaN or +inf score makes l NaN,
            // and that row's output must say so; l == 0 means every score it
            // saw was -inf, so every key dropped out and it is a row that sees
            // no key (or, for a split-KV part, no key of its range).
            const bool seen =
                (row_sees_keys(p_, R, g_) || sink_ != -simd::kInf) && l_[r] != 0.0f;
            if (!seen) std::memset(O_ + r * Dp_, 0, sizeof(float) * D);  // sees no key (nor a sink)
            const float inv = seen ? 1.0f / l_[r] : 1.0f;
            if (out.o)
                store_row(out.o + r * D, O_ + r * Dp_, D, inv);
            else
                store_row(static_cast<T*>(io_.o) + b_ * p_.o.b + h * p_.o.h + t * p_.o.t,
                          O_ + r * Dp_, D, inv);
            *lse = seen ? m_[r] + std::log(l_[r]) : -simd::kInf;
        }
    }

private:
    // Q^T, scaled, from q's rows.
    void load_queries(const T* q0, int D) {
        const int BQ = BQ_, nq = nq_, g = g_;
        const int64_t R0 = R0_, head0 = head0_;
        // Scores stay in natural units, scale * q times k (the backward
        // recomputes them bit for bit), until m is subtracted: s - m is exact
        // however large both are. Rows are first gathered whole (wide loads
        // keep many cache misses in flight), then transposed from L1.
        float* Qr = scratch(size_t(BQ) * D, 9);
        for (int r = 0; r < nq; ++r) {
            const int64_t R = R0 + r, t = R / g, h = head0 + R % g;
            load_row(Qr + r * D, q0 + h * p_.q.h + t * p_.q.t, D);
        }
        for (int d = 0; d < D; ++d) {
            for (int r = 0; r < nq; ++r) Qt_[d * BQ + r] = Qr[r * D + d] * p_.scale;
            for (int r = nq; r < BQ; ++r) Qt_[d * BQ + r] = 0.0f;
        }
    }

    const FlashParams& p_;
    const ForwardIO& io_;
    const int64_t b_, head0_;
    const int g_;
    const int64_t R0_;
    const int nq_, BQ_, Dp_;
    const T* const k0_;
    const T* const v0_;
    float* const Qt_;  // D x BQ, scaled (or D / 2 x BQ pairs of q, amx_)
    float* const O_;   // BQ x Dp
    float* const m_;
    float* const l_;
    const ScoreMods mods_;
    const bool masked_;
    const float sink_;
    const bool amx_;  // bfloat16 scores on AMX (cpu/amx.h); Qt_ holds q's pairs
    const PairedRows* const v_pairs_;  // on AMX, V in pairs for the whole call, or null
    bool have_max_ = false;  // every row has seen a key: m is finite
};

// One tile against the keys of `keys`, written to out.
template <class T>
void forward_block(const FlashParams& p, const ForwardIO& io, int64_t b, int64_t head0, int g,
                   int64_t R0, int nq, int BQ, Range keys, const TileOutput& out,
                   bool with_sink, const PairedRows* v_pairs) {
    TileState<T> tile(p, io, b, head0, g, R0, nq, BQ, with_sink,
                      scratch(TileState<T>::state_floats(p, BQ), 0), v_pairs);
    // Key blocks in order, except with ALiBi: its bias falls with the
    // distance from the diagonal, so the blocks go from the one holding the
    // first row's diagonal outwards (down, then up). The running max then
    // starts near its final value and later blocks rarely exceed it by the
    // headroom, which would make each of them a second pass.
    const int64_t n_blocks = (keys.end - keys.begin + kBlockK - 1) / kBlockK;
    const int64_t first = tile.alibi() && n_blocks > 0
                              ? std::clamp<int64_t>((R0 + p.Tk - p.Tq - keys.begin) / kBlockK, 0,
                                                    n_blocks - 1)
                              : 0;
    for (int64_t n = 0; n < n_blocks; ++n) {
        stop_if_interrupted();  // a tile may face a million keys
        const int64_t kb = n <= first ? first - n : n;  // first, first - 1, ..., 0, first + 1, ...
        const int64_t j0 = keys.begin + kb * kBlockK;
        if (n + 1 < n_blocks && !tile.alibi()) {  // the next block, while this one computes
            const int64_t j1 = j0 + kBlockK;
            tile.prefetch(j1, int(std::min<int64_t>(kBlockK, keys.end - j1)));
        }
        const int nk = int(std::min<int64_t>(kBlockK, keys.end - j0));
        KeyBlock<T> operands = tile.key_block(j0, nk);
        tile.step(j0, nk, operands);
    }
    tile.finish(out);
}

// Query tiles [0, n) of one kv head whose bands start at the same key (q
// as for forward_block; with_sink for each), carried through the key blocks
// together: each block's K and V are read, and half ones converted, once for
// all of them (KeyBlock) instead of once per tile. Each tile steps through
// the blocks forward_block would give it, in the same order, so its results
// are the same bit for bit.
template <class T>
void forward_group(const FlashParams& p, const ForwardIO& io, const QueryTile* tiles, int n,
                   int g, int BQ) {
    const size_t floats = TileState<T>::state_floats(p, BQ);
    float* state = scratch(size_t(n) * floats, 3);
    std::vector<TileState<T>> states;
    std::vector<int64_t> ends;
    states.reserve(size_t(n));
    const int64_t begin = keys_of_rows(p, tiles[0].R0, tiles[0].R0 + tiles[0].nq, g).begin;
    int64_t end = begin;
    for (int i = 0; i < n; ++i) {
        const QueryTile& x = tiles[i];
        states.emplace_back(p, io, x.b, x.head0, g, x.R0, x.nq, BQ, true,
                            state + size_t(i) * floats);
        ends.push_back(keys_of_rows(p, x.R0, x.R0 + x.nq, g).end);
        end = std::max(end, ends.back());
    }
    for (int64_t j0 = begin; j0 < end; j0 += kBlockK) {
        stop_if_interrupted();
        if (j0 + kBlockK < end) {  // the next block, while this one computes
            const int64_t j1 = j0 + kBlockK;
            states[0].prefetch(j1, int(std::min<int64_t>(kBlockK, end - j1)));
        }
        KeyBlock<T> operands = states[0].key_block(j0, int(std::min<int64_t>(kBlockK, end - j0)));
        for (int i = 0; i < n; ++i)
            if (j0 < ends[size_t(i)])
                states[size_t(i)].step(j0, int(std::min<int64_t>(kBlockK, ends[size_t(i)] - j0)),
                                       operands);
    }
    for (TileState<T>& tile : states) tile.finish(TileOutput{});
}

// Split-KV ("flash decoding"): a call with too few tasks to keep the cores
// busy (a decoding step has one per batch, its kv heads' tiles carried
// together) cuts the keys into chunks of at least kSplitMinKeys, one task
// each; every chunk leaves each of its tiles a partial o and lse, and a
// second pass merges them exactly (cpu/merge.h,
// fa.merge_states' formula). The split depends on the shape alone, never on
// the thread count, so neither do the results. Four tasks per core of a
// 16-core machine: with 16, one late thread held up the whole call.
constexpr int64_t kTargetTasks = 64;
constexpr int64_t kSplitMinKeys = 512;
constexpr size_t kDecodeStateBytes = 512 << 10;
// Keys per step when a task carries several kv heads: the heads' rows of a
// key share a 4 KiB page (float32, D = 128, 8 kv heads), so each step visits
// that many pages of K and as many of V, and the heads walk each page
// forward in turn. With 16 the L2 streamer can follow every one of those
// pages; with kBlockK (64) it could not (2026-12-04's Xeon: 10-11 GB/s
// against 22-24). On 2026-12-05's Zen 3 (AVX2) float32 rows read in place
// streamed 20-22 GB/s with 8 keys a step where 16 gave 16-17 and 4 gave 17;
// half rows, converted in memory order (decode_rows), as fast with 8, 16 or
// 32 at Tq = 1 but about 12 % slower with 8 than 16 at Tq = 4. Every dtype
// takes the same steps all the same, so that float16 and bfloat16 results
// are the float32 path's on the rounded inputs, bit for bit
// (tests/cpp/test_cpu_engine.cpp), except on AMX, whose tiles hold 16 rows.
constexpr int kDecodeBlockK = 8;
constexpr int kDecodeAmxBlockK = 16;
// Query tiles a task may carry through the same key blocks (half inputs),
// and the tasks per thread that grouping them must leave.
constexpr int64_t kGroupTiles = 4;
constexpr int64_t kTasksPerThread = 4;

// Decoding, half inputs: keys [j0, j0 + nk) of kv heads [hk0, hk0 + n) of
// batch b as float32, head i's K rows at K + i * kDecodeBlockK * D and its V
// rows, zero-padded to Dp, at V + i * kDecodeBlockK * Dp. Converted in the
// order they sit in memory (a key's heads side by side), one stream the
// hardware prefetchers follow; converting head by head, as each step asked
// for its rows, jumped a key's stride at every row and stalled on memory
// (bfloat16 decoding read 20-40 % faster converted this way, 2026-12-05).
template <class T>
void decode_rows(const FlashParams& p, const ForwardIO& io, int64_t b, int64_t hk0, int n,
                 int64_t j0, int nk, float* K, float* V) {
    const int D = p.D, Dp = int(round_up(D, W));
    const T* k = static_cast<const T*>(io.k) + b * p.k.b + hk0 * p.k.h + j0 * p.k.t;
    const T* v = static_cast<const T*>(io.v) + b * p.v.b + hk0 * p.v.h + j0 * p.v.t;
    for (int j = 0; j < nk; ++j)
        for (int i = 0; i < n; ++i) {
            load_row(K + (i * kDecodeBlockK + j) * D, k + j * p.k.t + i * p.k.h, D);
            float* row = V + (i * kDecodeBlockK + j) * Dp;
            load_row(row, v + j * p.v.t + i * p.v.h, D);
            for (int d = D; d < Dp; ++d) row[d] = 0.0f;
        }
}

// One call's work (cpu/call_phases.h): phase 0 the tasks, each one or more
// query tiles (or split-KV parts of one) through their keys; phase 1, with
// split-KV only, the merge of each tile's parts.
template <class T>
class ForwardCall final : public CallPhases {
public:
    ForwardCall(const FlashParams& call, const ForwardIO& call_io, Sharing sharing)
        : p(call), io(call_io) {
        // A kv head's query heads share a tile, unless a score option (whose
        // values are per head) is in force: then each head has its own tiles.
        g = p.score_mods == 0 ? p.group : 1;
        const int64_t units = int64_t(p.B) * p.H / g;  // per batch and kv head, or per query head
        rows = int64_t(p.Tq) * g;                      // per unit, its query heads packed
        BQ = query_block(rows, W);
        blocks = (rows + BQ - 1) / BQ;
        tiles = units * blocks;
        per_batch = p.H / g;
        tiles_per_batch = per_batch * blocks;
        // Decoding (all of a kv head's rows in one tile, its group packed): one
        // task carries several kv heads' tiles through the keys together, key
        // block by key block. A key's K (and V) rows of neighbouring heads sit
        // side by side, so the task reads one long stream the hardware
        // prefetchers follow, not 512-byte pieces a head stride apart (which
        // left decoding at a fraction of the read bandwidth). Their states stay
        // within kDecodeStateBytes, about a quarter of L2. (ALiBi tiles walk
        // their keys in their own order: forward_block.)
        alibi = p.score_mods & FA_SCORE_ALIBI;
        const int64_t heads_per_task =
            blocks == 1 && g == p.group && !alibi
                ? std::clamp<int64_t>(int64_t(kDecodeStateBytes /
                                              (sizeof(float) * TileState<T>::state_floats(p, BQ))),
                                      1, per_batch)
                : 1;
        const int64_t decode_tasks =
            p.B * ((tiles_per_batch + heads_per_task - 1) / heads_per_task) + sharing.other_tasks;
        splits = decode_tasks >= kTargetTasks
                     ? 1
                     : std::max<int64_t>(1, std::min((kTargetTasks + decode_tasks - 1) / decode_tasks,
                                                     int64_t(p.Tk) / kSplitMinKeys));
        // Half inputs, converted to float32 as each key block is loaded: a task
        // carries up to kGroupTiles query tiles of a kv head through the keys
        // together, so that each block is converted once for all of them
        // (forward_group; about a tenth of a bfloat16 forward's time went to
        // converting the same blocks once per tile). Fewer when the call would
        // leave too few tasks to share among the threads: the grouping changes
        // how the work is shared out, never what a tile computes.
        per_task = heads_per_task;
        if (!std::is_same_v<T, float> && !amx_scores<T>(p) && splits == 1 && blocks >= 2 && !alibi)
            for (per_task = std::min<int64_t>(kGroupTiles, blocks);
                 per_task > 1 &&
                 p.B * ((tiles_per_batch + per_task - 1) / per_task) + sharing.other_tasks <
                     kTasksPerThread * num_threads();
                 per_task /= 2) {
            }
        tasks_per_batch = (tiles_per_batch + per_task - 1) / per_task;
        n_tasks = p.B * tasks_per_batch;
        const size_t parts = splits == 1 ? 0 : size_t(tiles * splits);
        part_o.resize(parts * BQ * p.D);
        part_lse.resize(parts * BQ);
        // V in pairs where each key block meets several query tiles (tasks that
        // carry several heads lay out each block once and use it once).
        if (amx_scores<T>(p) && per_task == 1 && blocks >= 2)
            v_pairs = PairedRows(std::in_place_type<T>, io.v, p.v, p.B, p.H / p.group, p.Tk, p.D);
    }

    int phases() const override { return splits == 1 ? 1 : 2; }
    int64_t tasks(int phase) const override { return phase == 0 ? n_tasks * splits : tiles; }
    void run(int phase, int64_t task) override {
        if (phase == 0)
            run_task(task);
        else
            merge_tile(task);
    }

private:
    using Tile = QueryTile;

    // Consecutive tiles share a kv head, so its K and V stay in cache; within
    // a head the last query blocks (the most keys under a causal mask) come
    // first, so the tasks left at the end are small and threads finish together.
    Tile tile_of(int64_t t) const {
        const int64_t u = t / blocks, R0 = (blocks - 1 - t % blocks) * BQ;
        return Tile{u / per_batch, u % per_batch * g, R0, int(std::min<int64_t>(BQ, rows - R0))};
    }
    // Split s of a band of keys: chunks of whole key blocks.
    Range part_keys(Range band, int64_t s) const {
        const int64_t chunk =
            round_up((std::max<int64_t>(band.end - band.begin, 0) + splits - 1) / splits, kBlockK);
        const int64_t begin = std::min(band.end, band.begin + s * chunk);
        return Range{begin, std::min(band.end, begin + chunk)};
    }
    TileOutput output_of(int64_t t, int64_t s) const {
        return splits == 1 ? TileOutput{}
                           : TileOutput{part_o.data() + size_t(t * splits + s) * BQ * p.D,
                                        part_lse.data() + size_t(t * splits + s) * BQ};
    }

    void run_task(int64_t task) const {
        const AmxScope amx_tiles(amx_scores<T>(p));
        const int64_t u = task / splits, s = task % splits, first = u % tasks_per_batch * per_task;
        const int64_t t0 = u / tasks_per_batch * tiles_per_batch + first;
        const int64_t n = std::min(per_task, tiles_per_batch - first);
        const Tile x0 = tile_of(t0);
        const Range keys = part_keys(keys_of_rows(p, x0.R0, x0.R0 + x0.nq, g), s);
        // A sink is one logit of the row, not of each part: the first part has it.
        if (n == 1) {
            forward_block<T>(p, io, x0.b, x0.head0, g, x0.R0, x0.nq, BQ, keys, output_of(t0, s),
                             s == 0, &v_pairs);
            return;
        }
        if (blocks > 1) {  // query tiles: runs of one kv head and one first key share blocks
            Tile run[kGroupTiles];
            int in_run = 0;
            for (int64_t i = 0; i <= n; ++i) {
                const Tile x = i < n ? tile_of(t0 + i) : Tile{};
                if (in_run > 0 &&
                    (i == n || x.b != run[0].b || x.head0 != run[0].head0 ||
                     keys_of_rows(p, x.R0, x.R0 + x.nq, g).begin !=
                         keys_of_rows(p, run[0].R0, run[0].R0 + run[0].nq, g).begin)) {
                    forward_group<T>(p, io, run, in_run, g, BQ);
                    in_run = 0;
                }
                if (i < n) run[in_run++] = x;
            }
            return;
        }
        const size_t floats = TileState<T>::state_floats(p, BQ);
        float* state = scratch(size_t(n) * floats, 3);
        std::vector<TileState<T>> heads;
        heads.reserve(size_t(n));
        for (int64_t i = 0; i < n; ++i) {
            const Tile x = tile_of(t0 + i);
            heads.emplace_back(p, io, x.b, x.head0, g, x.R0, x.nq, BQ, s == 0,
                               state + size_t(i) * floats);
        }
        // Half inputs: each step's rows of all the task's kv heads converted
        // together, in memory order (decode_rows).
        const bool together = !std::is_same_v<T, float> && !amx_scores<T>(p);
        const int D = p.D, Dp = int(round_up(D, W));
        float* K = together ? scratch(size_t(n) * kDecodeBlockK * D, 13) : nullptr;
        float* V = together ? scratch(size_t(n) * kDecodeBlockK * Dp, 14) : nullptr;
        const int step_keys = amx_scores<T>(p) ? kDecodeAmxBlockK : kDecodeBlockK;
        for (int64_t j0 = keys.begin; j0 < keys.end; j0 += step_keys) {
            if ((j0 - keys.begin) % kBlockK == 0) stop_if_interrupted();  // each kBlockK keys
            const int nk = int(std::min<int64_t>(step_keys, keys.end - j0));
            if (together) decode_rows<T>(p, io, x0.b, x0.head0 / p.group, int(n), j0, nk, K, V);
            for (int64_t i = 0; i < n; ++i) {
                TileState<T>& head = heads[size_t(i)];
                KeyBlock<T> operands =
                    together ? KeyBlock<T>(p, K + i * kDecodeBlockK * D, D,
                                           V + i * kDecodeBlockK * Dp, Dp)
                             : head.key_block(j0, nk);  // (each its own K and V)
                head.step(j0, nk, operands);
            }
        }
        for (int64_t i = 0; i < n; ++i) heads[size_t(i)].finish(output_of(t0 + i, s));
    }

    void merge_tile(int64_t t) const {
        const Tile x = tile_of(t);
        const float* o_parts = part_o.data() + size_t(t * splits) * BQ * p.D;
        const float* lse_parts = part_lse.data() + size_t(t * splits) * BQ;
        float* merged = scratch(size_t(p.D), 0);  // one row, float32 until stored
        for (int r = 0; r < x.nq; ++r) {
            const int64_t R = x.R0 + r, tq = R / g, h = x.head0 + R % g;
            merge_row(int(splits), o_parts + r * p.D, int64_t(BQ) * p.D, lse_parts + r, BQ, p.D,
                      merged, io.lse + (x.b * p.H + h) * int64_t(p.Tq) + tq);
            store_row(static_cast<T*>(io.o) + x.b * p.o.b + h * p.o.h + tq * p.o.t, merged, p.D);
        }
    }

    const FlashParams p;
    const ForwardIO io;
    int g = 1;
    int64_t rows = 0;
    int BQ = 0;
    int64_t blocks = 0, tiles = 0, per_batch = 0, tiles_per_batch = 0;
    bool alibi = false;
    int64_t splits = 1, per_task = 1, tasks_per_batch = 0, n_tasks = 0;
    AlignedBuffer part_o, part_lse;
    PairedRows v_pairs;
};

}  // namespace

std::unique_ptr<CallPhases> forward_phases(const FlashParams& p, const ForwardIO& io,
                                           Sharing sharing) {
    std::unique_ptr<CallPhases> call;
    with_element_type(io.dtype, [&](auto element) {
        call = std::make_unique<ForwardCall<decltype(element)>>(p, io, sharing);
    });
    return call;
}

void attention_forward(const FlashParams& p, const ForwardIO& io) {
    run_phases(*FLASHATTN_CPU_ISA::forward_phases(p, io, Sharing{}));
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA

#include "cpu/isa_end.h"
