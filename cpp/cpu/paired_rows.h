// One bfloat16 input (V in the forward, q and dO in the backward) laid out
// in pairs of rows (cpu/amx.h row_pairs) once per call, for the AMX
// products that take it as their B operand: laying out a block for every
// tile that meets it cost the forward a sixth of its time at T = 4096. It is
// a bfloat16 copy (never a float32 one), made only where each block of rows
// serves several tiles; per head, round_up(rows, 32) + 32 rows, zeros past
// the input's.
#pragma once
#ifndef FLASHATTN_CPU_ISA
#error "include cpu/isa_begin.h first"
#endif

#include <utility>

#include "cpu/amx.h"
#include "cpu/thread_pool.h"
#include "cpu/tiles.h"

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

class PairedRows {
public:
    PairedRows() = default;

    // x: `heads` heads of `rows` rows (batch b at b * s.b, head h at h * s.h,
    // row t at t * s.t), D elements each; T is the element type (bfloat16
    // only: other types leave it off).
    template <class T>
    PairedRows(std::in_place_type_t<T>, const void* x, const FlashStrides& s, int64_t batches,
               int64_t heads, int64_t rows, int D)
        : heads_(heads), rows_(rows), Dp_(int(round_up(D, W))), padded_(round_up(rows, 32) + 32) {
#if defined(FLASHATTN_CPU_AMX)
        if constexpr (kAmxScores<T>) {
            constexpr int64_t kChunk = 512;  // rows per task
            const int64_t chunks = (padded_ + kChunk - 1) / kChunk;
            buffer_.resize(size_t(batches * heads * padded_ / 2 * Dp_));
            parallel_for(batches * heads * chunks, [&](int64_t task) {
                const int64_t u = task / chunks, t0 = task % chunks * kChunk;
                const int64_t b = u / heads, h = u % heads;
                const T* src = static_cast<const T*>(x) + b * s.b + h * s.h + t0 * s.t;
                const int n = int(std::clamp<int64_t>(rows - t0, 0, kChunk));
                row_pairs(src, s.t, n, D, Dp_, int(std::min(kChunk, padded_ - t0)),
                          base(b, h) + t0 * Dp_);
            });
            return;
        }
#endif
        (void)x, (void)s, (void)batches;
    }

    // Rows [t0, t0 + n) of batch b, head h, as the B operand of a product
    // over Kp = round_up(n, 32) rows: pair row t0 / 2 on. Null where the
    // layout is off, or its rows past n (up to Kp) would be other rows of
    // the input rather than its zero padding (a 0 in A, there, would meet
    // them: 0 * inf is NaN); the caller lays out that block itself.
    const BFloat16* block(int64_t b, int64_t h, int64_t t0, int n) const {
        if (buffer_.data() == nullptr || t0 % 2 != 0 || (n % 32 != 0 && t0 + n != rows_))
            return nullptr;
        return base(b, h) + t0 * Dp_;
    }

private:
    BFloat16* base(int64_t b, int64_t h) const {
        return reinterpret_cast<BFloat16*>(buffer_.data()) + (b * heads_ + h) * padded_ * Dp_;
    }

    int64_t heads_ = 0, rows_ = 0;
    int Dp_ = 0;
    int64_t padded_ = 0;
    AlignedBuffer buffer_;
};

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
