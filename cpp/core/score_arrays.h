// The score options' arrays of a call (ALiBi slopes, the mask, sinks) as the
// kernels index them: the Slot each is bound to, its element size, and the
// shape and element strides the kernels walk it with (FlashScoreParams and
// the kernels' fixed unit strides). One description for every GPU host, so
// that they bind the same arrays the same way: metal-sim binds each in place
// (sim/engine.cpp), the metal host stages each into a buffer (metal/
// staging.h) and writes back the strides of what it bound (set_strides).
#pragma once
#include <cstdint>
#include <vector>

#include "core/engine.h"
#include "core/plan.h"
#include "flash_params.h"

namespace flashattn {

// Every score option: what the Metal kernels (hence metal-sim and metal) apply.
constexpr int kEveryScoreMod = FA_SCORE_SOFTCAP | FA_SCORE_ALIBI | FA_SCORE_MASK_BOOL |
                               FA_SCORE_MASK_FLOAT | FA_SCORE_SINKS;

// A strided view of up to four axes; element (i0, .., i3) at data + sum(i_a *
// strides[a]) elements of element_bytes each.
struct ScoreArray {
    Slot slot;
    const void* data;
    int64_t element_bytes;  // 1: a bool mask; 4: float32
    int ndim;
    int64_t shape[4];
    int64_t strides[4];  // in elements; 0 where it broadcasts
};

// Whether a kernel reads `s` under these score_mods: a score slot that it
// does not read is bound to any buffer (Metal wants one at every index).
inline bool score_slot_used(Slot s, int score_mods) {
    switch (s) {
        case Slot::alibi: return (score_mods & FA_SCORE_ALIBI) != 0;
        case Slot::mask: return (score_mods & (FA_SCORE_MASK_BOOL | FA_SCORE_MASK_FLOAT)) != 0;
        case Slot::sinks: return (score_mods & FA_SCORE_SINKS) != 0;
        case Slot::seqs: return false;  // a varlen call binds it; a dense call's kernels never read it
        default: return true;
    }
}

// (And Slot::seqs, the varlen sequence table, which is optional the same
// way: a buffer that a dense call leaves to any buffer.)
inline bool is_score_slot(Slot s) {
    return s == Slot::alibi || s == Slot::mask || s == Slot::sinks || s == Slot::seqs;
}

// The arrays p.score_mods uses, as the kernels read them:
//   alibi: (B, H), slope (b, h) at b * alibi_b + h;
//   mask:  (B, H, Tq, Tk) through mask_b, mask_h, mask_i, mask_j, one byte
//          (bool) or a float32 per element;
//   sinks: (H,), contiguous.
inline std::vector<ScoreArray> score_arrays(const FlashParams& p, const ScoreInputs& in) {
    std::vector<ScoreArray> arrays;
    const FlashScoreParams& sp = in.params;
    if (p.score_mods & FA_SCORE_ALIBI)
        arrays.push_back({Slot::alibi, in.alibi_slopes, 4, 2, {p.B, p.H, 1, 1}, {sp.alibi_b, 1, 0, 0}});
    if (p.score_mods & (FA_SCORE_MASK_BOOL | FA_SCORE_MASK_FLOAT))
        arrays.push_back({Slot::mask, in.mask, (p.score_mods & FA_SCORE_MASK_BOOL) ? 1 : 4, 4,
                          {p.B, p.H, p.Tq, p.Tk}, {sp.mask_b, sp.mask_h, sp.mask_i, sp.mask_j}});
    if (p.score_mods & FA_SCORE_SINKS) arrays.push_back({Slot::sinks, in.sinks, 4, 1, {p.H, 1, 1, 1}, {1, 0, 0, 0}});
    return arrays;
}

// Records the strides of `a` (as rebound by a host) where the kernels read
// them. The unit strides (slopes and sinks along H) are the kernels' own:
// a host may only change a stride the kernels take from FlashScoreParams,
// or one of an axis of length 1.
inline void set_strides(FlashScoreParams& sp, const ScoreArray& a) {
    if (a.slot == Slot::alibi) sp.alibi_b = fa_int(a.strides[0]);
    if (a.slot == Slot::mask)
        sp.mask_b = a.strides[0], sp.mask_h = a.strides[1], sp.mask_i = a.strides[2],
        sp.mask_j = a.strides[3];
}

}  // namespace flashattn
