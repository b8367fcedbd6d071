// The GPU work of one call for a host that binds the call's own arrays
// where they are, with their strides: the in-stream paths
// (python/flashattn/_instream), which run the kernels inside MLX's or
// torch's GPU stream. It is the metal engine's, step for step: the same
// validation (make_*_params, make_score_inputs), the same plan
// (plan_forward / plan_backward, the score options' values in plan.score)
// and the same schedule of pieces (schedule_plan under
// work_model_from_env, so FLASHATTN_MAX_GROUPS_PER_PIECE applies).
#pragma once

#include "core/chunks.h"
#include "core/params.h"
#include "core/plan.h"

namespace flashattn {

struct CallPlan {
    // No (query, key) pair: nothing to launch. The host answers as
    // run_forward / run_backward do (o = 0, lse = the sink or -inf; zero
    // gradients, and the sinks' gradient from lse).
    bool empty = false;
    FlashParams params{};  // validated; the plan's own (rows_per_head, kv_splits) when not empty
    Plan plan;
    Schedule schedule;
};

// q: (B, Tq, H, D); k, v: (B, Tk, Hkv, D), of `dtype` (the views' dtype
// fields must say so); the score options' arrays as make_score_inputs takes
// them; `gpu` the GPU the call runs on, as the metal engine reads it from
// its device (split-KV decode is sized to its cores). Throws
// std::invalid_argument as the engines' calls do.
CallPlan plan_call_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                           const AttentionOptions& options, const ScoreOptions& score,
                           DType dtype, const GpuInfo& gpu = {});
CallPlan plan_call_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& o, const TensorView& lse,
                            const AttentionOptions& options, const ScoreOptions& score,
                            DType dtype);

}  // namespace flashattn
