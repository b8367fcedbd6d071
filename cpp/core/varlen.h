// Variable-length batches (fa.attention_varlen, flash_attn_varlen_func's
// semantics): sequence b is rows [cu_q[b], cu_q[b + 1]) of q and
// [cu_k[b], cu_k[b + 1]) of k and v, and computes what an ordinary call of
// B = 1 on those rows would, so the work is the sum of Tq_b * Tk_b, no
// padding is computed, and causal is bottom-right within each sequence. The
// whole batch is one engine call (Engine::forward_varlen). On the cpu
// engine, one parallel loop over every sequence's tiles (cpu/varlen.cpp).
// On metal and metal-sim, one plan with the launches of a dense call
// (forward 1, backward 3): the kernels read cu_q and cu_k themselves
// (Slot::seqs, engine.h's varlen_table), grid.z is the sequence, the grid is
// sized by the longest and a tile past a sequence's length exits at once
// (shaders/flash_device.h's fa_sequence; docs/metal.md, "Varlen"). Split-KV
// decode is not used for a varlen batch (core/plan.cpp's kv_splits).
#pragma once
#include <cstdint>
#include <vector>

#include "core/engine.h"
#include "core/params.h"

namespace flashattn {

// The sequences of a call: cu_q and cu_k (batch + 1 entries each), checked
// as prefix sums of total_q and total_k rows.
struct Sequences {
    std::vector<int64_t> cu_q, cu_k;
    int64_t batch() const { return int64_t(cu_q.size()) - 1; }
};
Sequences make_sequences(const char* fn, const int32_t* cu_q, int64_t n_q, const int32_t* cu_k,
                         int64_t n_k, int64_t total_q, int64_t total_k);

// The batch as the engines take it (engine.h's Varlen): each sequence's
// call (its rows of the packed arrays, the score options checked, their
// bits set) and the packed call; packed_score gets the packed call's score
// inputs. q (total_q, H, D), k and v (total_k, Hkv, D), as below.
Varlen make_varlen(const char* fn, const Sequences& seqs, const TensorView& q,
                   const TensorView& k, const TensorView& v, const AttentionOptions& options,
                   const ScoreOptions& score, ScoreInputs& packed_score);

// How the batch reaches the engine: in one call (the engine's own
// forward_varlen), or one ordinary call per sequence (Engine's default
// forward_varlen: the bench's and the tests' baseline).
enum class VarlenSchedule { one_call, per_sequence };

// q (total_q, H, D), k and v (total_k, Hkv, D), any strides with a
// contiguous last axis; score.alibi_slopes, if given, (batch, H). o is
// (total_q, H, D) of q's dtype and lse (H, total_q) float32, contiguous.
void run_forward_varlen(Engine& engine, const Sequences& seqs, const TensorView& q,
                        const TensorView& k, const TensorView& v, const AttentionOptions& options,
                        const ScoreOptions& score, void* o, float* lse,
                        VarlenSchedule schedule = VarlenSchedule::one_call);

// The gradients, shaped like q, k, v, contiguous, of q's dtype; dsinks (H,) with sinks.
void run_backward_varlen(Engine& engine, const Sequences& seqs, const TensorView& dout,
                         const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const float* lse, const AttentionOptions& options,
                         const ScoreOptions& score, void* dq, void* dk, void* dv,
                         float* dsinks, VarlenSchedule schedule = VarlenSchedule::one_call);

}  // namespace flashattn
