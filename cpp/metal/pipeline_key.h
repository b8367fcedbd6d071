// The name the metal host caches a compute pipeline under: the kernel name
// plus every function constant's index, type and exact bits. Portable C++ so
// that tests/cpp/test_metal_pipeline_key.cpp checks it on every platform: two
// floats that differ in the last bit (which a decimal rendering such as
// std::to_string's 6 digits would merge) get different pipelines.
#pragma once
#include <string>
#include <vector>

#include "core/plan.h"

namespace flashattn::metal {

inline std::string pipeline_key(const std::string& kernel,
                                const std::vector<FunctionConstant>& constants) {
    // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive)
    // on "|" + std::to_string(...) once this is inlined into core/selftest.cpp.
    std::string key = kernel;
    for (const FunctionConstant& c : constants) {
        key += '|';
        key += std::to_string(c.index);
        key += ':';
        key += std::to_string(int(c.type));
        key += '=';
        key += std::to_string(c.bits);
    }
    return key;
}

}  // namespace flashattn::metal
