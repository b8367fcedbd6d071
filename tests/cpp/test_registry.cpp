// One failing engine never takes the others down (cpp/engines/engine_set.h):
// a factory that throws is left out with its message as the reason, one that
// finds nothing to run on is left out with its stated reason, and the others
// start in order. Then the real registry of this build: cpu and metal-sim
// always there, metal either there or listed as missing with a reason.
#include <memory>
#include <stdexcept>
#include <string>

#include "check.h"
#include "core/registry.h"
#include "engines/engine_set.h"

using namespace flashattn;

namespace {

class NamedEngine final : public Engine {
public:
    explicit NamedEngine(std::string name) : name_(std::move(name)) {}
    std::string name() const override { return name_; }
    void forward(const FlashParams&, const ForwardIO&) override {}
    void backward(const FlashParams&, const BackwardIO&) override {}

private:
    std::string name_;
};

}  // namespace

int main() {
    {
        const EngineSet set = start_engines({
            {"metal", []() -> std::unique_ptr<Engine> {
                 throw std::runtime_error("metal: cannot load flashattn.metallib. Tried: /nowhere");
             }, "no device"},
            {"cpu", [] { return std::unique_ptr<Engine>(new NamedEngine("cpu")); }, ""},
            {"gpu2", [] { return std::unique_ptr<Engine>(); }, "no such device here"},
            {"odd", []() -> std::unique_ptr<Engine> { throw 42; }, ""},
            {"metal-sim", [] { return std::unique_ptr<Engine>(new NamedEngine("metal-sim")); }, ""},
        });
        CHECK(set.engines.size() == 2);
        CHECK(set.engines[0]->name() == "cpu" && set.engines[1]->name() == "metal-sim");
        CHECK(set.missing.size() == 3);
        CHECK(set.missing[0].name == "metal" && set.missing[0].failed);
        CHECK(set.missing[0].reason.find("/nowhere") != std::string::npos);
        CHECK(set.missing[1].name == "gpu2" && !set.missing[1].failed);
        CHECK(set.missing[1].reason == "no such device here");
        CHECK(set.missing[2].name == "odd" && set.missing[2].failed);
    }

    // This build's registry.
    const std::vector<std::string> names = available_engines();
    bool cpu = false, sim = false, metal = false;
    for (const std::string& n : names) {
        cpu |= n == "cpu";
        sim |= n == "metal-sim";
        metal |= n == "metal";
    }
    CHECK(cpu && sim);
    bool metal_missing = false;
    for (const MissingEngine& m : missing_engines())
        if (m.name == "metal") metal_missing = !m.reason.empty();
    CHECK(metal != metal_missing);  // exactly one: there, or missing with a reason
    if (!metal) CHECK_THROWS(std::invalid_argument, "not available", get_engine("metal"));
    CHECK(get_engine("cpu").name() == "cpu");
    return flashattn_test::finish("test_registry");
}
