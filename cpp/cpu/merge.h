// The exact merge of partial attention results over disjoint key ranges,
// for one query row: the formula of fa.merge_states (python/flashattn/
// _merge.py), which the split-KV forward uses to join its key chunks.
//
// With m = max_s lse_s and w_s = exp(lse_s - m) (each in [0, 1], so no lse
// magnitude overflows): lse = m + log(sum_s w_s), o = sum_s w_s o_s / sum_s w_s.
// Every part -inf: the row saw no key (o = 0, lse = -inf); a NaN part makes
// the row NaN.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

namespace flashattn::cpu {

// Part s's normalised o is o_parts + s * o_stride (D floats), its lse
// lse_parts[s * lse_stride].
inline void merge_row(int S, const float* o_parts, int64_t o_stride, const float* lse_parts,
                      int64_t lse_stride, int D, float* o, float* lse) {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    float m = -kInf;
    bool nan = false;
    for (int s = 0; s < S; ++s) {
        const float l = lse_parts[s * lse_stride];
        nan |= std::isnan(l);
        m = std::fmax(m, l);
    }
    if (nan) {
        for (int d = 0; d < D; ++d) o[d] = std::numeric_limits<float>::quiet_NaN();
        *lse = std::numeric_limits<float>::quiet_NaN();
        return;
    }
    if (m == -kInf) {
        for (int d = 0; d < D; ++d) o[d] = 0.0f;
        *lse = -kInf;
        return;
    }
    float total = 0.0f;
    for (int s = 0; s < S; ++s) total += std::exp(lse_parts[s * lse_stride] - m);
    const float inv = 1.0f / total;
    for (int d = 0; d < D; ++d) o[d] = 0.0f;
    for (int s = 0; s < S; ++s) {
        const float w = std::exp(lse_parts[s * lse_stride] - m) * inv;
        if (w == 0.0f) continue;  // an empty part: its o is 0, and 0 * inf must not appear
        const float* os = o_parts + s * o_stride;
        for (int d = 0; d < D; ++d) o[d] += w * os[d];
    }
    *lse = m + std::log(total);
}

}  // namespace flashattn::cpu
