// bfloat16 score tiles on AMX, Intel's matrix unit (Sapphire Rapids and
// later): 16 x 16 tiles of float32 accumulated over bfloat16 products, at
// several times the float32 FMA rate of the vector units. The forward
// computes S^T = K Q^T (K's rows read in place, q's pairs laid out once per
// tile), the backward S = Q K^T (q's rows in place, K's pairs laid out once
// per key block): each score is the same products in the same order, so the
// backward recomputes the forward's scores bit for bit, as it must (a
// saturated row's P is exactly 1 only then). Only the
// avx512 path of a Linux GCC build has it, and only where the CPU has
// AMX-TILE and AMX-BF16 and the kernel grants the process the tile state
// (arch_prctl); FLASHATTN_CPU_AMX=0 turns it off (tests compare both).
#pragma once
#ifndef FLASHATTN_CPU_ISA
#error "include cpu/isa_begin.h first"
#endif

#if defined(FLASHATTN_CPU_ISA_AVX512) && defined(__linux__) && defined(__x86_64__) && \
    defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define FLASHATTN_CPU_AMX 1
#endif

#include <type_traits>

#include "core/half.h"
#include "cpu/tiles.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

typedef uint32_t __attribute__((may_alias)) PairBits;  // two bfloat16, low element first

// Elements 2i and 2i + 1 of a bfloat16 row as one pair.
inline PairBits pair_at(const BFloat16* row, int i) {
    return PairBits(row[2 * i].bits) | PairBits(row[2 * i + 1].bits) << 16;
}

// Whether T's scores may come from AMX on this path at all (compile time).
template <class T>
inline constexpr bool kAmxScores =
#if defined(FLASHATTN_CPU_AMX)
    std::is_same_v<T, BFloat16>;
#else
    false;
#endif

#if defined(FLASHATTN_CPU_AMX)

// GCC 12 warns, at -O1 (the sanitizer builds), that '__Y' "is / may be used
// uninitialized" inside the AVX-512 intrinsics inlined below
// (_mm512_unpacklo_ps, _mm512_cvtepi32_epi16, ...): its headers pass
// _mm512_undefined_*(), written `__m512 __Y = __Y;`, as the unused
// pass-through operand. A false positive (GCC bug 105593): no value is read.
// Silenced for this block only; the pragma covers the code inlined from it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// True once the process may use the tiles (asked for at the first call).
inline bool amx_usable() {
    static const bool usable = [] {
        const char* env = std::getenv("FLASHATTN_CPU_AMX");
        if (env && env[0] == '0' && env[1] == '\0') return false;
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h
        return amx_bf16 && amx_tile &&
               syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return usable;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

#define FLASHATTN_AMX_FN __attribute__((target("amx-tile,amx-bf16"), visibility("hidden"))) inline

// All eight tiles, 16 rows of 64 bytes each, as the products below use them.
FLASHATTN_AMX_FN void amx_configure() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}
FLASHATTN_AMX_FN void amx_save(TileConfig* cfg) { _tile_storeconfig(cfg); }
FLASHATTN_AMX_FN void amx_restore(const TileConfig* cfg) {
    if (cfg->palette)
        _tile_loadconfig(cfg);
    else
        _tile_release();
}

// Configures the tiles again if something reset them since: glibc's lazy
// binding of a call (its register save and restore) or another library's
// use of AMX on the thread. Reading the configuration costs far less than
// loading it, which is too slow to do for each small product.
FLASHATTN_AMX_FN void amx_ensure_configured() {
    TileConfig now;
    _tile_storeconfig(&now);
    bool ours = now.palette == 1;
    for (int t = 0; t < 8; ++t) ours &= now.rows[t] == 16 && now.colsb[t] == 64;
    if (!ours) amx_configure();
}

// The tiles configured for one task's scope (the functions below run only
// inside one, and check that they still are). At its end the thread's tile
// configuration is put back as it was found (none, or another library's:
// oneDNN, under torch, may keep its own loaded between its calls and trust
// that it still is).
class AmxScope {
public:
    explicit AmxScope(bool on) : on_(on) {
        if (on_) amx_save(&saved_), amx_configure();
    }
    ~AmxScope() {
        if (on_) amx_restore(&saved_);
    }
    AmxScope(const AmxScope&) = delete;
    AmxScope& operator=(const AmxScope&) = delete;

private:
    const bool on_;
    TileConfig saved_;
};

// One block of C = A B over D (see amx_scores_tiles): RM (1 or 2) tiles of
// A's rows (a0, a1; byte strides sa0, sa1) against RN (1 or 2) tiles of B's
// columns, in tiles 0-3 (A in 4-5, B in 6-7). Up to four independent sums:
// a single one would wait out the latency of each product before the next.
template <int RM, int RN>
FLASHATTN_AMX_FN void amx_scores_block(const BFloat16* a0, int64_t sa0, const BFloat16* a1,
                                       int64_t sa1, int D, const PairBits* B, int ldb, float* C,
                                       int ldc) {
    const int64_t ldbb = ldb * int64_t(sizeof(PairBits)), ldcb = ldc * int64_t(sizeof(float));
    _tile_zero(0);
    if constexpr (RN > 1) _tile_zero(1);
    if constexpr (RM > 1) _tile_zero(2);
    if constexpr (RM > 1 && RN > 1) _tile_zero(3);
    for (int c = 0; c < D / 32; ++c) {
        const PairBits* b = B + c * 16 * ldb;
        _tile_loadd(4, a0 + c * 32, sa0);
        if constexpr (RM > 1) _tile_loadd(5, a1 + c * 32, sa1);
        _tile_loadd(6, b, ldbb);
        if constexpr (RN > 1) _tile_loadd(7, b + 16, ldbb);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (RN > 1) _tile_dpbf16ps(1, 4, 7);
        if constexpr (RM > 1) _tile_dpbf16ps(2, 5, 6);
        if constexpr (RM > 1 && RN > 1) _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, C, ldcb);
    if constexpr (RN > 1) _tile_stored(1, C + 16, ldcb);
    if constexpr (RM > 1) _tile_stored(2, C + 16 * ldc, ldcb);
    if constexpr (RM > 1 && RN > 1) _tile_stored(3, C + 16 * ldc + 16, ldcb);
}

// C (round_up(M, 16) x N float32, row stride ldc) = A B over D (a multiple
// of 32), unscaled: A is M bfloat16 rows, lda elements apart (K's or q's),
// B the other operand's pairs (D / 2 x N, row stride ldb; N a multiple of 16).
// Rows of C past M come out 0. Each score is the same products summed in the
// same order whichever block computes it.
FLASHATTN_AMX_FN void amx_scores_tiles(const BFloat16* A, int64_t lda, int M, int D,
                                       const PairBits* B, int ldb, int N, float* C, int ldc) {
    alignas(64) BFloat16 pad[16 * kMaxD];  // a partial tile of rows, zero after M
    const int full = M / 16 * 16;         // rows in whole tiles, read in place
    if (full < M) {
        std::memset(pad, 0, sizeof(BFloat16) * 16 * size_t(D));
        for (int r = 0; r < M - full; ++r)
            std::memcpy(pad + r * D, A + (full + r) * lda, sizeof(BFloat16) * size_t(D));
    }
    amx_ensure_configured();  // (after the copies: memcpy may be bound lazily)
    const int64_t sa = lda * int64_t(sizeof(BFloat16)), spad = D * int64_t(sizeof(BFloat16));
    auto tile = [&](int mt) { return mt < full ? A + mt * lda : pad; };
    auto stride = [&](int mt) { return mt < full ? sa : spad; };
    for (int mt = 0; mt < M; mt += 32) {
        const BFloat16 *a0 = tile(mt), *a1 = tile(mt + 16);
        const int64_t s0 = stride(mt), s1 = stride(mt + 16);
        float* c = C + mt * ldc;
        int nt = 0;
        if (mt + 16 < M) {
            for (; nt + 32 <= N; nt += 32)
                amx_scores_block<2, 2>(a0, s0, a1, s1, D, B + nt, ldb, c + nt, ldc);
            if (nt < N) amx_scores_block<2, 1>(a0, s0, a1, s1, D, B + nt, ldb, c + nt, ldc);
        } else {
            for (; nt + 32 <= N; nt += 32)
                amx_scores_block<1, 2>(a0, s0, a0, s0, D, B + nt, ldb, c + nt, ldc);
            if (nt < N) amx_scores_block<1, 1>(a0, s0, a0, s0, D, B + nt, ldb, c + nt, ldc);
        }
    }
}

// C (M x N float32, row stride ldc; M a multiple of 16, N of 32) += A B: A
// as bfloat16 rows (M x Kp, Kp a multiple of 32, zero past the summed
// range), B as pairs of its rows (Kp / 2 x N pairs, laid out by row_pairs).
// P V, P^T dO, dS^T q and dS K are all this product. With A_lo (laid out
// as A), C += (A + A_lo) B: the backward's P and dS split into a bfloat16
// and what it left (to_bf16_rest), both summed while C is in the tiles.
// Blocks of 32 x 32 of C stay in tiles 0-3 while the sum runs, against two
// tiles of A (4, 5) and two of B (6, 7): one tile load per product, where
// loading C, A and B for each would cost three; with A_lo, B's tiles serve
// both halves, and C is loaded and stored once for the two (the tile loads
// and stores, from L2, were most of the backward's time on AMX: issue 36).
FLASHATTN_AMX_FN void amx_accumulate(const BFloat16* A, int Kp, const BFloat16* Bv, int M, int N,
                                     float* C, int64_t ldc, const BFloat16* A_lo = nullptr) {
    amx_ensure_configured();
    const int64_t lda = Kp * int64_t(sizeof(BFloat16)), ldb = 2 * N * int64_t(sizeof(BFloat16));
    const int64_t ldcb = ldc * int64_t(sizeof(float));
    for (int nt = 0; nt < N; nt += 32) {  // N is a multiple of 32
        int mt = 0;
        for (; mt + 32 <= M; mt += 32) {
            float* c0 = C + mt * ldc + nt;
            float* c1 = c0 + 16 * ldc;
            _tile_loadd(0, c0, ldcb);
            _tile_loadd(1, c0 + 16, ldcb);
            _tile_loadd(2, c1, ldcb);
            _tile_loadd(3, c1 + 16, ldcb);
            for (int c = 0; c < Kp / 32; ++c) {
                const BFloat16* b = Bv + c * 16 * (2 * N) + 2 * nt;
                _tile_loadd(4, A + mt * Kp + c * 32, lda);
                _tile_loadd(5, A + (mt + 16) * Kp + c * 32, lda);
                _tile_loadd(6, b, ldb);
                _tile_loadd(7, b + 32, ldb);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
                if (A_lo) {
                    _tile_loadd(4, A_lo + mt * Kp + c * 32, lda);
                    _tile_loadd(5, A_lo + (mt + 16) * Kp + c * 32, lda);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c0, ldcb);
            _tile_stored(1, c0 + 16, ldcb);
            _tile_stored(2, c1, ldcb);
            _tile_stored(3, c1 + 16, ldcb);
        }
        if (mt < M) {  // one row tile left
            float* c0 = C + mt * ldc + nt;
            _tile_loadd(0, c0, ldcb);
            _tile_loadd(1, c0 + 16, ldcb);
            for (int c = 0; c < Kp / 32; ++c) {
                const BFloat16* b = Bv + c * 16 * (2 * N) + 2 * nt;
                _tile_loadd(4, A + mt * Kp + c * 32, lda);
                _tile_loadd(6, b, ldb);
                _tile_loadd(7, b + 32, ldb);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (A_lo) {
                    _tile_loadd(5, A_lo + mt * Kp + c * 32, lda);
                    _tile_dpbf16ps(0, 5, 6);
                    _tile_dpbf16ps(1, 5, 7);
                }
            }
            _tile_stored(0, c0, ldcb);
            _tile_stored(1, c0 + 16, ldcb);
        }
    }
}

// Out (Kp / 2 rows of 2 Dp) = rows [0, n) of a bfloat16 matrix X (ld apart,
// D elements, D a multiple of 32) in pairs: row k holds X[2k][d],
// X[2k + 1][d] side by side for each d; zeros past n and past D.
inline void row_pairs(const BFloat16* X, int64_t ld, int n, int D, int Dp, int Kp,
                      BFloat16* out) {
    const __m512i lo_half = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i hi_half = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int k = 0; k < Kp / 2; ++k, out += 2 * Dp) {
        const BFloat16* a = 2 * k < n ? X + 2 * k * ld : nullptr;
        const BFloat16* b = 2 * k + 1 < n ? X + (2 * k + 1) * ld : nullptr;
        for (int d = 0; d < D; d += 32) {
            const __m512i x = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
            const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
            const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
            _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi64(lo, lo_half, hi));
            _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi64(lo, hi_half, hi));
        }
        for (int d = 2 * D; d < 2 * Dp; ++d) out[d] = BFloat16{0};
    }
}

// factor * x rounded to bfloat16, nearest even, by integer arithmetic (the
// inputs here are never signalling NaNs, so NaN stays NaN).
inline __m256i to_bf16(__m512 x, __m512 factor) {
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(x, factor));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
}

// The part of factor * x that to_bf16 rounded off, itself rounded: hi + lo
// carries 16 significant bits of x, so a product summed from both operands
// errs about as much as a float32 one.
inline __m256i to_bf16_rest(__m512 x, __m512 factor, __m256i hi) {
    const __m512 top = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
    return to_bf16(_mm512_sub_ps(_mm512_mul_ps(x, factor), top), _mm512_set1_ps(1.0f));
}

// Transposes 16 rows of 16 floats in registers: x[i][j] becomes x[j][i]
// (pairs, then quadruples, then 128-bit lanes).
inline void transpose16(__m512 (&x)[16]) {
    __m512 t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(x[i], x[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(x[i], x[i + 1]);
    }
    __m512 u[16];  // u[4 i + e], lane L: column 4 L + e of rows 4 i .. 4 i + 3
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
#pragma GCC unroll 4
    for (int e = 0; e < 4; ++e) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x44);
        const __m512 v1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xee);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xee);
        x[e] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        x[4 + e] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
        x[8 + e] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        x[12 + e] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
    }
}

// Out (rows x Kp bfloat16) = factor * X^T: out[r][j] = X[j][r] for the
// cols columns of X (row stride ld, a multiple of 16 at least
// round_up(cols, 16)) that become out's first rows, and its n rows (the
// summed range); zeros past n and from row `cols` on. With lo, also what
// the rounding left (to_bf16_rest), laid out the same. Blocks of 16 x 16
// are transposed in registers.
inline void transposed_rows(const float* X, int64_t ld, int n, int cols, int rows, int Kp,
                            float factor, BFloat16* out, BFloat16* lo = nullptr) {
    const __m512 f = _mm512_set1_ps(factor);
    std::memset(out + cols * Kp, 0, sizeof(BFloat16) * size_t(rows - cols) * Kp);
    if (lo) std::memset(lo + cols * Kp, 0, sizeof(BFloat16) * size_t(rows - cols) * Kp);
    for (int r0 = 0; r0 < cols; r0 += 16)
        for (int j0 = 0; j0 < Kp; j0 += 16) {
            __m512 x[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i)
                x[i] = j0 + i < n ? _mm512_loadu_ps(X + (j0 + i) * ld + r0) : _mm512_setzero_ps();
            transpose16(x);
            for (int i = 0; i < 16 && r0 + i < cols; ++i) {
                const __m256i hi = to_bf16(x[i], f);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + i) * Kp + j0), hi);
                if (lo)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + (r0 + i) * Kp + j0),
                                        to_bf16_rest(x[i], f, hi));
            }
        }
}

// Out (rows x Kp bfloat16) = factor * X for X's first n rows and cols
// columns (row stride ld); zeros past them. With lo, also what the rounding
// left, as in transposed_rows.
inline void rounded_rows(const float* X, int64_t ld, int n, int cols, int rows, int Kp,
                         float factor, BFloat16* out, BFloat16* lo = nullptr) {
    const __m512 f = _mm512_set1_ps(factor);
    std::memset(out + n * Kp, 0, sizeof(BFloat16) * size_t(rows - n) * Kp);
    if (lo) std::memset(lo + n * Kp, 0, sizeof(BFloat16) * size_t(rows - n) * Kp);
    for (int r = 0; r < n; ++r)
        for (int j = 0; j < Kp; j += 16) {
            const __mmask16 in = j >= cols ? 0 : cols - j >= 16 ? 0xffff : (1u << (cols - j)) - 1u;
            const __m512 x = _mm512_maskz_loadu_ps(in, X + r * ld + j);
            const __m256i hi = to_bf16(x, f);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * Kp + j), hi);
            if (lo)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + r * Kp + j),
                                    to_bf16_rest(x, f, hi));
        }
}

#pragma GCC diagnostic pop

#else
class AmxScope {
public:
    explicit AmxScope(bool) {}
};
#endif  // FLASHATTN_CPU_AMX

// True when no element of the rows x cols bfloat16 block (row stride ld) is
// inf or NaN.
inline bool all_finite(const BFloat16* x, int rows, int cols, int64_t ld) {
    uint32_t bad = 0;
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) bad |= uint32_t((x[r * ld + c].bits & 0x7f80u) == 0x7f80u);
    return bad == 0;
}

// Whether this call's bfloat16 scores come from AMX: a head size that is a
// multiple of 32 (whole tiles of pairs), on a CPU and kernel that allow it.
template <class T>
inline bool amx_scores(const FlashParams& p) {
#if defined(FLASHATTN_CPU_AMX)
    return kAmxScores<T> && p.D % 32 == 0 && amx_usable();
#else
    (void)p;
    return false;
#endif
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
