// Constructors of the engines, one per engine directory; the registry calls them.
#pragma once
#include <memory>

#include "core/engine.h"

namespace flashattn {

std::unique_ptr<Engine> make_cpu_engine();       // cpp/cpu
std::unique_ptr<Engine> make_metal_sim_engine(); // cpp/sim
// The self-test's lane probe run on metal-sim: "" when the layout is the
// kernels' (core/selftest.h), else what differs.
std::string sim_lane_probe();
// cpp/metal (Apple only): nullptr when this machine has no Metal device.
std::unique_ptr<Engine> make_metal_engine();

}  // namespace flashattn
