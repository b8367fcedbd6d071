// The GPU's class and core count for the plan (gpu_info.h).
#include "core/gpu_info.h"

namespace flashattn {

int fewest_cores_of_class(const std::string& architecture) {
    // "applegpu_g" + generation digits + class letter.
    if (architecture.rfind("applegpu_", 0) != 0 || architecture.size() < 11) return 8;
    switch (architecture.back()) {
        case 'p': return 4;   // A-series phones and tablets
        case 'g': return 7;   // M1 to M4 and their Pro chips (the base M1 has 7 or 8)
        case 's': return 24;  // Max (M1 Max 24 or 32, M2 Max 30 or 38, M3/M4 Max 30 to 40)
        case 'd': return 48;  // Ultra (M1 Ultra 48 or 64, M2 Ultra 60 or 76, M3 Ultra 60 or 80)
        default: return 8;
    }
}

GpuInfo gpu_info_from(int registry_cores, const std::string& architecture) {
    GpuInfo info;
    info.cores = registry_cores > 0 ? registry_cores : fewest_cores_of_class(architecture);
    return info;
}

}  // namespace flashattn
