// The parameters of one attention call, shared byte for byte by the Metal
// kernels (MSL) and the C++ core, plus the masking rule both sides apply.
#pragma once

#ifdef __METAL_VERSION__
typedef int fa_int;
typedef long fa_long;
#define FA_INLINE inline
#else
#include <cstdint>
typedef int32_t fa_int;
typedef int64_t fa_long;
#define FA_INLINE inline
#endif

// Element strides of a (B, T, heads, D) tensor. The D axis always has stride 1.
struct FlashStrides {
    fa_long b, t, h;
};

// Everything a kernel needs to know about a call. Built and validated once by
// flashattn::make_params (cpp/core/params.cpp); kernels trust it.
//
// Masking is normalised into the window: query row i sits at key position
// p = i + Tk - Tq (bottom-right alignment) and sees keys j with
// p - window_left <= j <= p + window_right. Unbounded sides are stored as
// Tk (left) and Tq (right), which reach past every key; causal caps right at 0.
struct FlashParams {
    fa_int B, Tq, Tk, H, Hkv, D;
    fa_int group;        // H / Hkv: query heads that share one kv head
    fa_int window_left;  // >= 0
    fa_int window_right; // >= 0
    float scale;         // multiplies q.k before the softmax
    fa_int kv_splits;    // split-KV decode: key ranges computed apart, then merged (else 1)
    // Query rows of a kv head are numbered r = g * rows_per_head + t (g: the
    // query head within the GQA group, t: the row), and the forward and dQ
    // kernels take them FA_BLOCK_ROWS at a time. rows_per_head = Tq packs the
    // heads of a group into shared blocks (decode: every K/V row is read once
    // per kv head); Tq rounded up to a block keeps every block in one head.
    fa_int rows_per_head;
    // Added to [[threadgroup_position_in_grid]] by every kernel: a host may
    // dispatch a launch's grid in pieces (bounded work per command buffer),
    // each piece with its own origin.
    fa_int group_offset_x, group_offset_y, group_offset_z;
    // The score options in force (FA_SCORE_* bits; issue 16), their values in
    // FlashScoreParams. 0 is plain attention, which then reads nothing more.
    fa_int score_mods;
    // A variable-length batch (fa.attention_varlen) runs as one launch
    // (core/varlen.h): the call's params have varlen_seqs = its number of
    // sequences (0 for an ordinary call); each sequence's own params (B = 1,
    // its Tq and Tk, its rows_per_head) give its first rows of the packed
    // q (seq_q0) and k (seq_k0) and its index in the batch (seq_index).
    // (The four ints keep the strides 8-byte aligned, as MSL lays them out.)
    fa_int varlen_seqs, seq_q0, seq_k0, seq_index;
    FlashStrides q, k, v, o, dout, dq, dk, dv;
};

// FlashParams.score_mods bits, applied to each score s = scale * q.k in
// this order: softcap (s = softcap * tanh(s / softcap)), ALiBi (s -= slope *
// |p - j|), the mask (bool: hidden where false; float: added); then a sink
// joins each row's softmax denominator as one more logit with a zero value.
#define FA_SCORE_SOFTCAP 1
#define FA_SCORE_ALIBI 2
#define FA_SCORE_MASK_BOOL 4
#define FA_SCORE_MASK_FLOAT 8
#define FA_SCORE_SINKS 16

// The values of the score options (which apply: FlashParams.score_mods).
// The mask is read in place: element (b, h, i, j) at b * mask_b + h * mask_h
// + i * mask_i + j * mask_j, zero strides where it broadcasts.
struct FlashScoreParams {
    float softcap;   // > 0 with FA_SCORE_SOFTCAP
    fa_int alibi_b;  // slope of (b, h) at slopes[b * alibi_b + h]: 0 for (H,) slopes
    fa_long mask_b, mask_h, mask_i, mask_j;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(FlashStrides) == 24, "FlashStrides layout must match MSL");
static_assert(sizeof(FlashParams) == 272, "FlashParams layout must match MSL");
static_assert(sizeof(FlashScoreParams) == 40, "FlashScoreParams layout must match MSL");
#endif

// Keys [fa_key_begin, fa_key_end) are visible to query row i; empty when begin >= end.
FA_INLINE fa_long fa_key_begin(fa_long i, fa_int Tq, fa_int Tk, fa_int left) {
    const fa_long first = i + Tk - Tq - left;
    return first > 0 ? first : 0;
}
FA_INLINE fa_long fa_key_end(fa_long i, fa_int Tq, fa_int Tk, fa_int right) {
    const fa_long end = i + Tk - Tq + right + 1;
    return end < 0 ? 0 : (end > Tk ? fa_long(Tk) : end);
}
// Query rows [fa_query_begin, fa_query_end) see key j (the same rule, solved for i).
FA_INLINE fa_long fa_query_begin(fa_long j, fa_int Tq, fa_int Tk, fa_int right) {
    const fa_long first = j - right - (Tk - Tq);
    return first > 0 ? first : 0;
}
FA_INLINE fa_long fa_query_end(fa_long j, fa_int Tq, fa_int Tk, fa_int left) {
    const fa_long end = j + left - (Tk - Tq) + 1;
    return end < 0 ? 0 : (end > Tq ? fa_long(Tq) : end);
}
