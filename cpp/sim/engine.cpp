// The "metal-sim" engine: plans a call exactly as the metal engine does and
// runs the plan through the launcher on the CPU. Slow; it exists to test
// the GPU kernels and their dispatch on machines without Metal.
#include <vector>

#include "core/plan.h"
#include "core/score_arrays.h"
#include "engines/factories.h"
#include "sim/launcher.h"

namespace flashattn {
namespace {

// The score options' arrays, bound in place as core/score_arrays.h describes
// them; one the call does not use is bound to `any` (the kernels read none
// of them without its score_mods bit, as the metal host does).
void bind_score_arrays(sim::SlotPointers& slots, const FlashParams& p, const ScoreInputs& in,
                       const void* any) {
    for (Slot s : {Slot::alibi, Slot::mask, Slot::sinks}) slots[size_t(s)] = const_cast<void*>(any);
    for (const ScoreArray& a : score_arrays(p, in)) slots[size_t(a.slot)] = const_cast<void*>(a.data);
}

class MetalSimEngine final : public Engine {
public:
    std::string name() const override { return "metal-sim"; }

    // The kernels come in every storage type (shaders' FA_STORAGE_TYPES).
    bool dtype_supported(DType) const override { return true; }

    // The kernels apply every score option, both ways.
    int score_mods_supported(bool) const override {
        return kEveryScoreMod;
    }

    void forward(const FlashParams& p, const ForwardIO& io) override {
        Plan plan = plan_forward(p, io.dtype);
        plan.score = io.score.params;
        sim::SlotPointers slots{};
        bind_score_arrays(slots, p, io.score, io.q);
        slots[size_t(Slot::q)] = const_cast<void*>(io.q);
        slots[size_t(Slot::k)] = const_cast<void*>(io.k);
        slots[size_t(Slot::v)] = const_cast<void*>(io.v);
        slots[size_t(Slot::o)] = io.o;
        slots[size_t(Slot::lse)] = io.lse;
        sim::run_plan(plan, slots);
    }

    void backward(const FlashParams& p, const BackwardIO& io) override {
        Plan plan = plan_backward(p, io.dtype);
        plan.score = io.score.params;
        sim::SlotPointers slots{};
        bind_score_arrays(slots, p, io.score, io.q);
        slots[size_t(Slot::dout)] = const_cast<void*>(io.dout);
        slots[size_t(Slot::q)] = const_cast<void*>(io.q);
        slots[size_t(Slot::k)] = const_cast<void*>(io.k);
        slots[size_t(Slot::v)] = const_cast<void*>(io.v);
        slots[size_t(Slot::o)] = const_cast<void*>(io.o);
        slots[size_t(Slot::lse)] = const_cast<float*>(io.lse);
        slots[size_t(Slot::dq)] = io.dq;
        slots[size_t(Slot::dk)] = io.dk;
        slots[size_t(Slot::dv)] = io.dv;
        sim::run_plan(plan, slots);
    }
};

}  // namespace

std::unique_ptr<Engine> make_metal_sim_engine() { return std::make_unique<MetalSimEngine>(); }

}  // namespace flashattn
