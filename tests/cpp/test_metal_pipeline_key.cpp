// The metal host's pipeline cache key (cpp/metal/pipeline_key.h): exact bits,
// so two close floats never share a pipeline; index and type are part of it.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "check.h"
#include "metal/pipeline_key.h"

using namespace flashattn;
using flashattn::metal::pipeline_key;

namespace {

FunctionConstant float_constant(uint16_t index, float value) {
    FunctionConstant c;
    c.index = index;
    c.type = FunctionConstant::Type::float32;
    std::memcpy(&c.bits, &value, sizeof value);
    return c;
}

}  // namespace

int main() {
    const float a = 0.1f, b = std::nextafter(a, 1.0f);  // one ulp apart
    CHECK(std::to_string(a) == std::to_string(b));         // what the old key merged
    CHECK(pipeline_key("k", {float_constant(0, a)}) != pipeline_key("k", {float_constant(0, b)}));
    CHECK(pipeline_key("k", {float_constant(0, 0.0f)}) !=
          pipeline_key("k", {float_constant(0, -0.0f)}));
    CHECK(pipeline_key("k", {float_constant(0, a)}) == pipeline_key("k", {float_constant(0, a)}));
    CHECK(pipeline_key("k", {float_constant(0, a)}) != pipeline_key("k", {float_constant(1, a)}));
    FunctionConstant as_int = float_constant(0, a);
    as_int.type = FunctionConstant::Type::int32;
    CHECK(pipeline_key("k", {as_int}) != pipeline_key("k", {float_constant(0, a)}));
    CHECK(pipeline_key("k", {}) == "k" && pipeline_key("k", {}) != pipeline_key("j", {}));
    return flashattn_test::finish("test_metal_pipeline_key");
}
