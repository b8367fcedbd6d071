// Validation at the boundary: turns the arrays and options of a call into a
// checked, normalised FlashParams (shaders/flash_params.h), or throws
// std::invalid_argument naming the argument and what was seen.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/engine.h"
#include "core/tensor.h"
#include "flash_params.h"

namespace flashattn {

constexpr int kMaxHeadDim = 256;

struct AttentionOptions {
    bool causal = false;
    int64_t window_left = -1;   // -1: unbounded
    int64_t window_right = -1;  // -1: unbounded
    std::optional<double> scale;  // default 1/sqrt(D)
};

// The score options of a call (issue 16), as the bindings receive them:
// arrays already broadcast to their full shapes (zero strides, not copies).
struct ScoreOptions {
    double softcap = 0.0;                    // 0: off
    std::optional<TensorView> alibi_slopes;  // (B, H) float32, contiguous along H
    std::optional<TensorView> mask;          // (B, H, Tq, Tk), any strides
    bool mask_is_bool = false;               // one byte per element, else float32
    std::optional<TensorView> sinks;         // (H,) float32, contiguous
};

// Checks the score options against the call p, sets p.score_mods, and
// returns the arrays and values the kernels read.
ScoreInputs make_score_inputs(const char* fn, FlashParams& p, const ScoreOptions& options);

// q: (B, Tq, H, D); k, v: (B, Tk, Hkv, D). Fills shapes, q/k/v strides, the
// normalised window and scale; o, dq, dk, dv strides describe contiguous outputs.
FlashParams make_forward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                                const AttentionOptions& options);

// As above, and checks dout and o against q's shape and lse against (B, H, Tq);
// fills their strides (lse must be contiguous).
FlashParams make_backward_params(const TensorView& dout, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& o, const TensorView& lse,
                                 const AttentionOptions& options);

// The checks of make_forward_params on shapes alone, as function `fn`
// reports them: how fa.reference gives the engines' errors.
void check_call_shapes(const std::string& fn, const std::vector<int64_t>& q_shape,
                       const std::vector<int64_t>& k_shape, const std::vector<int64_t>& v_shape,
                       const AttentionOptions& options);

// Element counts of the contiguous outputs.
inline int64_t q_elements(const FlashParams& p) { return int64_t(p.B) * p.Tq * p.H * p.D; }
inline int64_t kv_elements(const FlashParams& p) { return int64_t(p.B) * p.Tk * p.Hkv * p.D; }
inline int64_t lse_elements(const FlashParams& p) { return int64_t(p.B) * p.H * p.Tq; }

}  // namespace flashattn
