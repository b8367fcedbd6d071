// cpp/core/engine.cpp's refusal of score options: an engine whose kernels
// do not apply an option (Engine::score_mods_supported) never sees a call
// that uses it; run_forward / run_backward raise std::invalid_argument (a
// ValueError in Python) naming the engine and each missing option, and an
// engine that applies the option is handed the call.
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "core/engine.h"
#include "core/params.h"
#include "core/score_arrays.h"

using namespace flashattn;

namespace {

class CountingEngine final : public Engine {
public:
    explicit CountingEngine(int supported) : supported_(supported) {}
    std::string name() const override { return "counting"; }
    int score_mods_supported(bool backward) const override {
        return backward ? supported_ & ~FA_SCORE_SINKS : supported_;
    }
    void forward(const FlashParams&, const ForwardIO&) override { ++calls; }
    void backward(const FlashParams&, const BackwardIO&) override { ++calls; }
    int calls = 0;

private:
    int supported_;
};

TensorView view(const float* data, std::vector<int64_t> shape) {
    std::vector<int64_t> strides(shape.size(), 1);
    for (int a = int(shape.size()) - 2; a >= 0; --a) strides[a] = strides[a + 1] * shape[a + 1];
    return TensorView{data, std::move(shape), std::move(strides)};
}

}  // namespace

int main() {
    const int64_t B = 1, T = 5, H = 2, D = 8;
    std::vector<float> x(B * T * H * D, 0.25f), o(x.size()), lse(B * H * T), g(x.size());
    std::vector<float> sinks(H, 0.5f), dsinks(H);
    std::vector<unsigned char> mask(T, 1);
    const TensorView xv = view(x.data(), {B, T, H, D});
    FlashParams p = make_forward_params(xv, xv, xv, {});
    ScoreOptions so;
    so.softcap = 3.0;
    so.mask = TensorView{reinterpret_cast<const float*>(mask.data()), {B, H, T, T}, {0, 0, 0, 1}};
    so.mask_is_bool = true;
    so.sinks = view(sinks.data(), {H});
    const ScoreInputs score = make_score_inputs("attention", p, so);
    const ForwardIO fio{x.data(), x.data(), x.data(), o.data(), lse.data(), score};
    BackwardIO bio{x.data(), x.data(), x.data(), x.data(), o.data(),
                   lse.data(), g.data(), g.data(), g.data(), score};
    bio.dsinks = dsinks.data();

    CountingEngine none(0);
    CHECK_THROWS(std::invalid_argument,
                 "attention: the counting engine does not implement softcap, mask, sinks yet",
                 run_forward(none, p, fio));
    CHECK_THROWS(std::invalid_argument, "does not implement softcap, mask, sinks in the backward",
                 run_backward(none, p, bio));
    CHECK(none.calls == 0);

    // This one lacks only sinks in the backward.
    CountingEngine most(kEveryScoreMod);
    run_forward(most, p, fio);
    CHECK(most.calls == 1);
    CHECK_THROWS(std::invalid_argument,
                 "attention_backward: the counting engine does not implement sinks in the backward",
                 run_backward(most, p, bio));
    CHECK(most.calls == 1);
    return flashattn_test::finish("test_engine");
}
