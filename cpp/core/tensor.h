// A view of an array handed in from Python: data pointer, element type,
// shape and element strides. No ownership; the caller keeps the array alive.
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

// p advanced by `elements` elements of type d.
inline const void* element_offset(const void* p, int64_t elements, DType d) {
    return static_cast<const char*>(p) + elements * int64_t(dtype_size(d));
}
inline void* element_offset(void* p, int64_t elements, DType d) {
    return static_cast<char*>(p) + elements * int64_t(dtype_size(d));
}

struct TensorView {
    const void* data = nullptr;
    std::vector<int64_t> shape;
    std::vector<int64_t> strides;  // in elements, one per axis
    DType dtype = DType::f32;

    int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
    // The element `elements` past data, as a pointer.
    const void* at(int64_t elements) const { return element_offset(data, elements, dtype); }
};

// "(2, 128, 8, 64)", as NumPy prints a shape.
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace flashattn
