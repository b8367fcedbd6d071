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

// C (round_up(M, 16) x N float32, row stride ldc) = A B over D (a multiple
// of 32), unscaled: A is M bfloat16 rows, lda elements apart (K's or q's),
// B the other operand's pairs (D / 2 x N, row stride ldb; N a multiple of 16).
// Rows of C past M come out 0. The tile state is set up and released here,
// so another library's AMX use on the same thread is not disturbed.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_scores_tiles(
    const BFloat16* A, int64_t lda, int M, int D, const PairBits* B, int ldb, int N, float* C,
    int ldc) {
    TileConfig cfg;
    for (int t = 0; t < 3; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    alignas(64) BFloat16 pad[16 * kMaxD];  // a partial tile of rows, zero after M
    for (int mt = 0; mt < M; mt += 16) {
        const BFloat16* a = A + mt * lda;
        int64_t a_stride = lda * int64_t(sizeof(BFloat16));
        if (M - mt < 16) {
            std::memset(pad, 0, sizeof(BFloat16) * 16 * size_t(D));
            for (int r = 0; r < M - mt; ++r)
                std::memcpy(pad + r * D, a + r * lda, sizeof(BFloat16) * size_t(D));
            a = pad, a_stride = D * int64_t(sizeof(BFloat16));
        }
        for (int nt = 0; nt < N; nt += 16) {
            _tile_zero(0);
            for (int c = 0; c < D / 32; ++c) {
                _tile_loadd(1, a + c * 32, a_stride);
                _tile_loadd(2, B + c * 16 * ldb + nt, ldb * int64_t(sizeof(PairBits)));
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, C + mt * ldc + nt, ldc * int64_t(sizeof(float)));
        }
    }
    _tile_release();
}

#endif  // FLASHATTN_CPU_AMX

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
