// A view of a float32 array handed in from Python: data pointer, shape and
// element strides. No ownership; the caller keeps the array alive.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace flashattn {

struct TensorView {
    const float* data = nullptr;
    std::vector<int64_t> shape;
    std::vector<int64_t> strides;  // in elements, one per axis

    int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
};

// "(2, 128, 8, 64)", as NumPy prints a shape.
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace flashattn
