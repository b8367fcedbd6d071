// The interface every engine (cpu, metal-sim, metal) implements, and the
// pointers a call hands it. Pointers address element [0, 0, 0, 0] of each
// array; the strides (in elements) are in FlashParams. q, k, v, o, do and
// the gradients all have the call's dtype (ForwardIO/BackwardIO::dtype);
// lse and the score options' arrays are float32 whatever it is.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "flash_params.h"

namespace flashattn {

class SelfTest;  // core/selftest.h

// The arrays of the score options (FlashParams.score_mods says which are
// given; the others are null) and their values.
struct ScoreInputs {
    FlashScoreParams params{};
    const float* alibi_slopes = nullptr;  // see FlashScoreParams.alibi_b
    const void* mask = nullptr;           // bool (one byte each) or float32, by score_mods
    const float* sinks = nullptr;         // (H,)
};

struct ForwardIO {
    const void *q, *k, *v;  // of `dtype`
    void* o;                // of `dtype`, (B, Tq, H, D) contiguous
    float* lse;             // (B, H, Tq) contiguous
    ScoreInputs score{};
    DType dtype = DType::f32;
};

struct BackwardIO {
    const void *dout, *q, *k, *v, *o;  // of `dtype`
    const float* lse;
    void *dq, *dk, *dv;  // of `dtype`, contiguous, shaped like q, k, v
    ScoreInputs score{};
    float* dsinks = nullptr;  // (H,) with sinks; written by run_backward, not the engine
    DType dtype = DType::f32;
};

// A variable-length batch as one call (core/varlen.h builds it): sequence i
// is the ordinary call seqs[i] (B = 1, its own Tq and Tk, the packed arrays'
// strides; seq_q0, seq_k0 its first rows there, seq_index its index).
// packed has the shapes and options shared by all (H, Hkv, D, window,
// scale, score_mods), B = the number of sequences, Tq and Tk the longest,
// varlen_seqs = B. Its IO (VarlenIO) holds the packed arrays: q, o, do, dq
// (total_q, H, D) and k, v, dk, dv (total_k, Hkv, D), o and the gradients
// contiguous; lse in the sequences' layout: sequence i's (H, Tq_i) block,
// contiguous, at element H * seq_q0; the ALiBi slopes (batch, H) (row i at
// i * alibi_b). Sequences with no query or no key are in seqs too: an
// engine skips them (core/varlen.cpp writes their outputs) or computes the
// same values.
struct Varlen {
    FlashParams packed{};
    std::vector<FlashParams> seqs;
};

// Sequence i's arrays as an ordinary call's (views into the packed ones).
ForwardIO sequence_io(const Varlen& call, const ForwardIO& io, size_t i);
BackwardIO sequence_io(const Varlen& call, const BackwardIO& io, size_t i);

// The sequences' table the GPU kernels read in a one-launch varlen call
// (Slot::seqs; shaders/flash_device.h's fa_sequence): cu_seqlens_q then
// cu_seqlens_k as int32, seqs.size() + 1 entries each.
std::vector<int32_t> varlen_table(const Varlen& call);

// Whether sequence i has work (queries and keys).
inline bool sequence_has_work(const FlashParams& seq) { return seq.Tq > 0 && seq.Tk > 0; }

// Memory for one output array. `owner` keeps it alive; Python holds it in a
// capsule, so an engine's buffer returns to its pool when the array dies.
struct OutputBuffer {
    void* data = nullptr;
    std::shared_ptr<void> owner;
};

class Engine {
public:
    virtual ~Engine() = default;
    virtual std::string name() const = 0;

    // The FA_SCORE_* options this engine's kernels apply, forward or
    // backward; run_forward and run_backward refuse a call that uses any other.
    virtual int score_mods_supported(bool backward) const {
        (void)backward;
        return 0;
    }

    // Non-empty when the engine must not be used any more in this process
    // (its self-test failed: core/selftest.h): the registry then leaves it
    // out of the available engines, with this reason.
    virtual std::string unusable_reason() const { return {}; }

    // The engine's self-test (core/selftest.h), where it runs one.
    virtual SelfTest* selftest() const { return nullptr; }

    // The dtypes this engine's kernels take (float32 always); run_forward
    // and run_backward refuse a call in any other, naming engine and dtype.
    virtual bool dtype_supported(DType dtype) const { return dtype == DType::f32; }

    // `bytes` of output memory. Default: 64-byte aligned host memory.
    // Throws std::bad_alloc when it cannot.
    virtual OutputBuffer allocate(size_t bytes);

    // Engines may assume B, H, Tq >= 1 and Tk >= 1 (run_forward/run_backward
    // handle empty calls) and must write every output element, including the
    // rows that see no key (o = 0, lse = -inf; zero gradients).
    virtual void forward(const FlashParams& p, const ForwardIO& io) = 0;
    virtual void backward(const FlashParams& p, const BackwardIO& io) = 0;

    // A variable-length batch (Varlen) in one launch. The default runs
    // forward / backward once per sequence with work, one after another (an
    // engine whose kernels read the sequences themselves overrides it; the
    // bench and the tests call this one as the per-sequence baseline).
    // dsinks is left to the caller, as in backward().
    virtual void forward_varlen(const Varlen& call, const ForwardIO& io);
    virtual void backward_varlen(const Varlen& call, const BackwardIO& io);
};

// Runs a call on an engine, answering the degenerate shapes (nothing to
// compute, or no keys at all) here, once for every engine; the backward also
// computes dsinks here, from do, o and lse, for every engine alike.
void run_forward(Engine& engine, const FlashParams& p, const ForwardIO& io);
void run_backward(Engine& engine, const FlashParams& p, const BackwardIO& io);

// Refuses (std::invalid_argument, as function fn) a call using score
// options or a dtype the engine does not take.
void check_engine_takes(const char* fn, const Engine& engine, const FlashParams& p, bool backward,
                        DType dtype);

// Adds to dsinks[h] (H of them, summed in double) the sink gradient of call
// p from do, o and lse (io.score.sinks given).
void add_sink_gradients(const FlashParams& p, const BackwardIO& io, double* dsinks);

}  // namespace flashattn
