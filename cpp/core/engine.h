// The interface every engine (cpu, metal-sim, metal) implements, and the
// pointers a call hands it. Pointers address element [0, 0, 0, 0] of each
// array; the strides (in elements) are in FlashParams. q, k, v, o, do and
// the gradients all have the call's dtype (ForwardIO/BackwardIO::dtype);
// lse and the score options' arrays are float32 whatever it is.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "core/tensor.h"
#include "flash_params.h"

namespace flashattn {

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
};

// Runs a call on an engine, answering the degenerate shapes (nothing to
// compute, or no keys at all) here, once for every engine; the backward also
// computes dsinks here, from do, o and lse, for every engine alike.
void run_forward(Engine& engine, const FlashParams& p, const ForwardIO& io);
void run_backward(Engine& engine, const FlashParams& p, const BackwardIO& io);

}  // namespace flashattn
