// What the plan is told about the GPU (core/plan.h's GpuInfo), from what the
// metal host can read of the device: the IORegistry's gpu-core-count where
// the system reports it, and the architecture name (MTLDevice.architecture
// .name, e.g. "applegpu_g14d"), whose last letter is the GPU's class as MLX
// reads it: p (phone), g (base and Pro chips), s (Max), d (Ultra).
// Portable so that tests check it on every machine.
#pragma once
#include <string>

#include "core/plan.h"

namespace flashattn {

// The fewest GPU cores of an architecture's class (a Max chip has 24 to 40,
// an Ultra 48 to 80...): what the plan assumes when the count is not
// reported; 8 (an M1) for a name it does not know.
int fewest_cores_of_class(const std::string& architecture);

// registry_cores when positive (the count the system reports), else the
// class's fewest.
GpuInfo gpu_info_from(int registry_cores, const std::string& architecture);

}  // namespace flashattn
