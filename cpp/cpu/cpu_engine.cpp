// The "cpu" engine: the tiled, multithreaded C++ attention behind the Engine
// interface. It keeps no state, so concurrent calls need no lock.
#include "cpu/attention.h"
#include "engines/factories.h"

namespace flashattn {
namespace {

class CpuEngine final : public Engine {
public:
    std::string name() const override { return "cpu"; }
    int score_mods_supported(bool) const override {
        return FA_SCORE_SOFTCAP | FA_SCORE_ALIBI | FA_SCORE_MASK_BOOL | FA_SCORE_MASK_FLOAT |
               FA_SCORE_SINKS;
    }
    // float32, float16 and bfloat16 (cpu/convert.h: converted as tiles load).
    bool dtype_supported(DType) const override { return true; }
    void forward(const FlashParams& p, const ForwardIO& io) override {
        cpu::attention_forward(p, io);
    }
    void backward(const FlashParams& p, const BackwardIO& io) override {
        cpu::attention_backward(p, io);
    }
    void forward_varlen(const Varlen& call, const ForwardIO& io) override {
        cpu::attention_forward_varlen(call, io);
    }
    void backward_varlen(const Varlen& call, const BackwardIO& io) override {
        cpu::attention_backward_varlen(call, io);
    }
};

}  // namespace

std::unique_ptr<Engine> make_cpu_engine() { return std::make_unique<CpuEngine>(); }

}  // namespace flashattn
