// The GPU engines' self-test (issue 34): nothing here has run on an Apple
// GPU, so the metal engine proves itself on the user's machine before it is
// trusted, and fails loudly instead of answering wrong.
//  1. When the engine starts, the lane probe (shaders/flash_selftest.metal):
//     one SIMD group loads known 8x8 matrices into simdgroup matrices and
//     writes what each lane holds; check_lane_probe compares that with the
//     layout every tiled kernel assumes (fa_lane). A failure keeps the
//     engine from starting (fa.backends() leaves it out, with the reason).
//  2. At the first use of each pipeline (kernel name and function-constant
//     values: kernel x head size x dtype x options), SelfTest runs a tiny
//     call whose plan uses that pipeline -- a known-answer test: the same
//     call on the cpu engine is the answer, within the accuracy rule's
//     bound (below) -- forward for forward pipelines, backward for backward
//     ones; a varlen call's pipelines get a varlen probe call. A failure
//     leaves the engine out for the rest of the process
//     (Engine::unusable_reason) and throws SelfTestFailed naming the
//     pipeline, the probe call and the error; the bindings warn and, when no
//     backend was named, answer the call on the next engine.
// Portable: metal-sim runs the same code (FLASHATTN_METAL_SELFTEST=1 turns
// it on there; the metal engine runs it unless FLASHATTN_METAL_SELFTEST=0).
//
// The bound: |engine - cpu| <= f * max(e32, 1e-6 m) + u m per array, m its
// largest |cpu| element, f = 2 for o and lse and 3 for gradients (the
// accuracy rule's factors), e32 = 4 eps32 sqrt(K) m a plain float32
// implementation's error on sums of K = max(D, Tk) terms, u the dtype's
// ulp (each side rounds its float32 result once: f16 2^-10, bf16 2^-7).
// A wrong lane layout moves whole rows and columns: errors of order m.
#pragma once
#include <chrono>
#include <functional>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/engine.h"
#include "core/plan.h"

namespace flashattn {

// The lane probe: one threadgroup of one SIMD group, buffer 0 (Slot::q) the
// input matrix (kLaneProbeInputs floats), buffer 1 (Slot::o) the output.
constexpr int kLaneProbeInputs = 64;
constexpr int kLaneProbeOutputs = 224;
Launch lane_probe_launch();
std::vector<float> lane_probe_input();
// "" when `out` (kLaneProbeOutputs floats) is what the kernels' layout
// gives; else the first difference, lane and element named.
std::string check_lane_probe(const float* out);

struct SelfTestFailed : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// FLASHATTN_METAL_SELFTEST: "0" off, "1" on, unset: `otherwise`. Any other
// value throws std::invalid_argument naming it.
bool selftest_enabled(bool otherwise);

class SelfTest {
public:
    // `reference` gives the engine the answers come from (the cpu engine).
    SelfTest(std::string engine, GpuInfo gpu, std::function<Engine&()> reference);

    // Before `call` runs on `engine` (whose forward / backward are the paths
    // the call takes): the known-answer test of every pipeline of its plan
    // not tested yet. Throws SelfTestFailed when one fails, and for every
    // call after that. Calls made by the tests themselves pass through.
    void check_forward(Engine& engine, const FlashParams& call, DType dtype);
    void check_backward(Engine& engine, const FlashParams& call, DType dtype);
    // The same for a one-launch varlen call (Engine::forward_varlen): its
    // pipelines (function constant FA_FC_VARLEN) are tested by a varlen
    // probe call, a few sequences of awkward lengths packed, on both
    // engines' own forward_varlen / backward_varlen.
    void check_forward_varlen(Engine& engine, const Varlen& call, DType dtype);
    void check_backward_varlen(Engine& engine, const Varlen& call, DType dtype);

    // "" while every test has passed; else the failure, as thrown.
    std::string failure() const;

    struct Stats {
        int pipelines = 0;     // pipelines that passed
        int probes = 0;        // probe calls run (each on both engines)
        double seconds = 0.0;  // wall time spent in them, both engines
    };
    Stats stats() const;

private:
    void check(Engine& engine, const Plan& plan, const FlashParams& call, DType dtype, bool backward);

    const std::string engine_;
    const GpuInfo gpu_;
    const std::function<Engine&()> reference_;
    mutable std::mutex mu_;
    std::set<std::string> passed_;
    std::string failure_;
    Stats stats_;
};

}  // namespace flashattn
