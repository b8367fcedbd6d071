// The in-stream paths' plan of a call: the metal engine's steps (see call_plan.h).
#include "core/call_plan.h"

namespace flashattn {
namespace {

CallPlan finish(FlashParams p, const ScoreInputs& score, DType dtype, bool backward,
                const GpuInfo& gpu) {
    CallPlan call;
    call.params = p;
    call.empty = q_elements(p) == 0 || p.Tk == 0;
    if (call.empty) return call;
    call.plan = backward ? plan_backward(p, dtype) : plan_forward(p, dtype, gpu);
    call.plan.score = score.params;
    call.params = call.plan.params;
    call.schedule = schedule_plan(call.plan, work_model_from_env());
    return call;
}

}  // namespace

CallPlan plan_call_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                           const AttentionOptions& options, const ScoreOptions& score,
                           DType dtype, const GpuInfo& gpu) {
    FlashParams p = make_forward_params(q, k, v, options);
    const ScoreInputs in = make_score_inputs("attention", p, score);
    return finish(p, in, dtype, false, gpu);
}

CallPlan plan_call_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& o, const TensorView& lse,
                            const AttentionOptions& options, const ScoreOptions& score,
                            DType dtype) {
    FlashParams p = make_backward_params(dout, q, k, v, o, lse, options);
    const ScoreInputs in = make_score_inputs("attention_backward", p, score);
    return finish(p, in, dtype, true, GpuInfo{});
}

}  // namespace flashattn
