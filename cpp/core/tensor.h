// A view of a float32 array handed in from Python: data pointer, shape and
// element strides. No ownership; the caller keeps the array alive.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flashattn {

// The element types of q, k, v, o, do and the gradients (issue 15): one per
// call. lse and the score options' arrays are float32 always.
enum class DType : uint8_t { f32, f16, bf16 };

inline size_t dtype_size(DType d) { return d == DType::f32 ? 4 : 2; }

// "float32", "float16", "bfloat16": NumPy's names, for messages.
inline const char* dtype_name(DType d) {
    switch (d) {
        case DType::f32: return "float32";
        case DType::f16: return "float16";
        case DType::bf16: return "bfloat16";
    }
    return "?";
}

struct TensorView {
    const float* data = nullptr;
    std::vector<int64_t> shape;
    std::vector<int64_t> strides;  // in elements, one per axis

    int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
};

// "(2, 128, 8, 64)", as NumPy prints a shape.
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace flashattn
