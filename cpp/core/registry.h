// The engines this build has, best first, and lookup by name.
#pragma once
#include <string>
#include <vector>

#include "core/engine.h"

namespace flashattn {

// e.g. {"metal", "cpu", "metal-sim"}; only engines usable on this machine.
std::vector<std::string> available_engines();

// An engine this build has (or would have on another platform or with another
// build option) that is not usable here, and why; `failed` when it was built
// and tried to start but threw (a metallib that does not load, a device the
// kernels cannot run on), as opposed to simply absent.
struct MissingEngine {
    std::string name;
    std::string reason;
    bool failed = false;
};
std::vector<MissingEngine> missing_engines();

// nullptr name picks the best; an unknown name throws std::invalid_argument
// listing the available ones.
Engine& get_engine(const std::string& name);
Engine& default_engine();

}  // namespace flashattn
