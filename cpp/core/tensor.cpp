// Formatting of shapes for error messages.
#include "core/tensor.h"

namespace flashattn {

std::string shape_string(const std::vector<int64_t>& shape) {
    std::string s = "(";
    for (size_t i = 0; i < shape.size(); ++i) {
        if (i) s += ", ";
        s += std::to_string(shape[i]);
    }
    if (shape.size() == 1) s += ",";
    return s + ")";
}

}  // namespace flashattn
