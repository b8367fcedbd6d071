// The "metal-sim" engine: plans a call exactly as the metal engine does and
// runs the plan through the launcher on the CPU. Slow; it exists to test
// the GPU kernels and their dispatch on machines without Metal.
#include <vector>

#include "core/plan.h"
#include "engines/factories.h"
#include "sim/launcher.h"

namespace flashattn {
namespace {

class MetalSimEngine final : public Engine {
public:
    std::string name() const override { return "metal-sim"; }

    void forward(const FlashParams& p, const ForwardIO& io) override {
        const Plan plan = plan_forward(p);
        sim::SlotPointers slots{};
        slots[size_t(Slot::q)] = const_cast<float*>(io.q);
        slots[size_t(Slot::k)] = const_cast<float*>(io.k);
        slots[size_t(Slot::v)] = const_cast<float*>(io.v);
        slots[size_t(Slot::o)] = io.o;
        slots[size_t(Slot::lse)] = io.lse;
        sim::run_plan(plan, slots);
    }

    void backward(const FlashParams& p, const BackwardIO& io) override {
        const Plan plan = plan_backward(p);
        sim::SlotPointers slots{};
        slots[size_t(Slot::dout)] = const_cast<float*>(io.dout);
        slots[size_t(Slot::q)] = const_cast<float*>(io.q);
        slots[size_t(Slot::k)] = const_cast<float*>(io.k);
        slots[size_t(Slot::v)] = const_cast<float*>(io.v);
        slots[size_t(Slot::o)] = const_cast<float*>(io.o);
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
