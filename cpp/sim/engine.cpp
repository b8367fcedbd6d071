// The "metal-sim" engine: plans a call exactly as the metal engine does and
// runs the plan through the launcher on the CPU. Slow; it exists to test
// the GPU kernels and their dispatch on machines without Metal.
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "core/plan.h"
#include "core/selftest.h"
#include "core/score_arrays.h"
#include "engines/factories.h"
#include "sim/launcher.h"

namespace flashattn {
namespace {

// The score options' arrays, bound in place as core/score_arrays.h describes
// them; one the call does not use is bound to the launcher's unused-slot
// buffer, as the metal host binds its dedicated buffer there (the kernels
// read none of them without its score_mods bit); so is the varlen table's
// slot, which a dense call's kernels never read.
void bind_score_arrays(sim::SlotPointers& slots, const FlashParams& p, const ScoreInputs& in) {
    for (Slot s : {Slot::alibi, Slot::mask, Slot::sinks, Slot::seqs})
        slots[size_t(s)] = sim::unused_slot_buffer();
    for (const ScoreArray& a : score_arrays(p, in)) slots[size_t(a.slot)] = const_cast<void*>(a.data);
}

// The lane probe (core/selftest.h) run on the simulator: what each lane holds.
std::vector<float> run_lane_probe() {
    const Launch launch = lane_probe_launch();
    const sim::Kernel* kernel = sim::find_kernel(launch.kernel);
    if (!kernel) throw std::runtime_error("metal-sim: no kernel named '" + launch.kernel + "'");
    std::vector<float> in = lane_probe_input(), out(kLaneProbeOutputs, std::nanf(""));
    sim::run_launch(*kernel, {{in.data(), false}, {out.data(), false}}, launch.grid,
                    launch.threadgroup, launch.constants);
    return out;
}

class MetalSimEngine final : public Engine {
public:
    // With FLASHATTN_METAL_SELFTEST=1 the simulator runs the metal engine's
    // self-test, as that engine does on a Mac: the lane probe now (a failure
    // keeps the engine from starting), each pipeline's known-answer call at
    // its first use (against a cpu engine of its own).
    MetalSimEngine() {
        if (!selftest_enabled(false)) return;
        const std::string error = check_lane_probe(run_lane_probe().data());
        if (!error.empty()) throw std::runtime_error("metal-sim engine self-test failed: " + error);
        selftest_ = std::make_unique<SelfTest>("metal-sim", GpuInfo{}, [this]() -> Engine& {
            std::call_once(reference_once_, [this] { reference_ = make_cpu_engine(); });
            return *reference_;
        });
    }

    std::string name() const override { return "metal-sim"; }

    std::string unusable_reason() const override {
        return selftest_ ? selftest_->failure() : std::string();
    }
    SelfTest* selftest() const override { return selftest_.get(); }

    // The kernels come in every storage type (shaders' FA_STORAGE_TYPES).
    bool dtype_supported(DType) const override { return true; }

    // The kernels apply every score option, both ways.
    int score_mods_supported(bool) const override {
        return kEveryScoreMod;
    }

    void forward(const FlashParams& p, const ForwardIO& io) override {
        if (selftest_) selftest_->check_forward(*this, p, io.dtype);
        run_forward_plan(p, io, nullptr);
    }

    void backward(const FlashParams& p, const BackwardIO& io) override {
        if (selftest_) selftest_->check_backward(*this, p, io.dtype);
        run_backward_plan(p, io, nullptr);
    }

    // A variable-length batch in one plan, as the metal engine's: the
    // kernels read the sequences' table (Slot::seqs) and map grid.z to the
    // sequence; the self-test checks its varlen pipelines with a varlen probe.
    void forward_varlen(const Varlen& call, const ForwardIO& io) override {
        if (selftest_) selftest_->check_forward_varlen(*this, call, io.dtype);
        const std::vector<int32_t> table = varlen_table(call);
        run_forward_plan(call.packed, io, table.data());
    }

    void backward_varlen(const Varlen& call, const BackwardIO& io) override {
        if (selftest_) selftest_->check_backward_varlen(*this, call, io.dtype);
        const std::vector<int32_t> table = varlen_table(call);
        run_backward_plan(call.packed, io, table.data());
    }

private:
    void run_forward_plan(const FlashParams& p, const ForwardIO& io, const int32_t* seqs) {
        Plan plan = plan_forward(p, io.dtype);
        plan.score = io.score.params;
        sim::SlotPointers slots{};
        bind_score_arrays(slots, p, io.score);
        slots[size_t(Slot::q)] = const_cast<void*>(io.q);
        slots[size_t(Slot::k)] = const_cast<void*>(io.k);
        slots[size_t(Slot::v)] = const_cast<void*>(io.v);
        slots[size_t(Slot::o)] = io.o;
        slots[size_t(Slot::lse)] = io.lse;
        if (seqs) slots[size_t(Slot::seqs)] = const_cast<int32_t*>(seqs);
        sim::run_plan(plan, slots);
    }

    void run_backward_plan(const FlashParams& p, const BackwardIO& io, const int32_t* seqs) {
        Plan plan = plan_backward(p, io.dtype);
        plan.score = io.score.params;
        sim::SlotPointers slots{};
        bind_score_arrays(slots, p, io.score);
        slots[size_t(Slot::dout)] = const_cast<void*>(io.dout);
        slots[size_t(Slot::q)] = const_cast<void*>(io.q);
        slots[size_t(Slot::k)] = const_cast<void*>(io.k);
        slots[size_t(Slot::v)] = const_cast<void*>(io.v);
        slots[size_t(Slot::o)] = const_cast<void*>(io.o);
        slots[size_t(Slot::lse)] = const_cast<float*>(io.lse);
        slots[size_t(Slot::dq)] = io.dq;
        slots[size_t(Slot::dk)] = io.dk;
        slots[size_t(Slot::dv)] = io.dv;
        if (seqs) slots[size_t(Slot::seqs)] = const_cast<int32_t*>(seqs);
        sim::run_plan(plan, slots);
    }

    std::unique_ptr<SelfTest> selftest_;  // null unless FLASHATTN_METAL_SELFTEST=1
    std::once_flag reference_once_;
    std::unique_ptr<Engine> reference_;
};

}  // namespace

std::unique_ptr<Engine> make_metal_sim_engine() { return std::make_unique<MetalSimEngine>(); }

std::string sim_lane_probe() { return check_lane_probe(run_lane_probe().data()); }

}  // namespace flashattn
