// Starting the engines one by one, so that one that fails (a missing or
// unloadable metallib, a bad FLASHATTN_METALLIB, a device that does not
// initialise or lacks what the kernels need) is left out with its reason and
// never takes the others down. The registry (registry.cpp) uses this with the
// real factories; tests/cpp/test_registry.cpp with failing ones.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/engine.h"
#include "core/registry.h"

namespace flashattn {

struct EngineFactory {
    std::string name;
    // nullptr: the engine has nothing to run on here (e.g. no Metal device);
    // an exception: it failed to start. Either way `name` is left out.
    std::function<std::unique_ptr<Engine>()> make;
    std::string when_null;  // the reason recorded when make() returns nullptr
};

struct EngineSet {
    std::vector<std::unique_ptr<Engine>> engines;  // in the factories' order
    std::vector<MissingEngine> missing;
};

// Never throws for a failing factory: its exception's message becomes the reason.
EngineSet start_engines(const std::vector<EngineFactory>& factories);

}  // namespace flashattn
