// The "cpu" engine: the tiled, multithreaded C++ attention behind the Engine
// interface. It keeps no state, so concurrent calls need no lock.
#include "cpu/attention.h"
#include "engines/factories.h"

namespace flashattn {
namespace {

class CpuEngine final : public Engine {
public:
    std::string name() const override { return "cpu"; }
    void forward(const FlashParams& p, const ForwardIO& io) override {
        cpu::attention_forward(p, io);
    }
    void backward(const FlashParams& p, const BackwardIO& io) override {
        cpu::attention_backward(p, io);
    }
};

}  // namespace

std::unique_ptr<Engine> make_cpu_engine() { return std::make_unique<CpuEngine>(); }

}  // namespace flashattn
