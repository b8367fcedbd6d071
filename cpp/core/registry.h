// The engines this build has, best first, and lookup by name.
#pragma once
#include <string>
#include <vector>

#include "core/engine.h"

namespace flashattn {

// e.g. {"metal", "cpu", "metal-sim"}; only engines usable on this machine.
std::vector<std::string> available_engines();

// nullptr name picks the best; an unknown name throws std::invalid_argument
// listing the available ones.
Engine& get_engine(const std::string& name);
Engine& default_engine();

}  // namespace flashattn
