// XLA FFI handlers for flashattn.jax: forward and backward on the cpu engine,
// called by XLA's CPU runtime from a jitted program with no Python (and no
// GIL) involved. xla_bindings.cpp exports them from flashattn._core as
// capsules that jax.ffi.register_ffi_target takes.
//
// Buffers arrive row-major and dense. Leading axes beyond the four of the
// layout (added by jax.vmap's "broadcast_all" rule) are folded into B, so
// q is (..., Tq, H, D), k and v (..., Tk, Hkv, D), lse (..., H, Tq).
// Attributes: causal (bool), window_left, window_right (int), scale (float).
#include <cmath>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bindings/xla_handlers.h"
#include "core/engine.h"
#include "core/params.h"
#include "core/registry.h"

namespace flashattn {
namespace {

using namespace xla_ffi;

xla_ffi::Error* make_error(const CallFrame* frame, ErrorCode code, const std::string& message) {
    ErrorCreateArgs args{};
    args.struct_size = sizeof(ErrorCreateArgs);
    args.message = message.c_str();
    args.errc = code;
    return frame->api->error_create(&args);
}

// Answers XLA's metadata query (made at registration); true if it was one.
bool answer_metadata(CallFrame* frame) {
    for (ExtensionBase* ext = frame->extension_start; ext; ext = ext->next) {
        if (ext->type != kExtensionMetadata) continue;
        Metadata* md = reinterpret_cast<MetadataExtension*>(ext)->metadata;
        md->api_version.major_version = kApiMajor;
        md->api_version.minor_version = kApiMinor;
        md->traits = 0;
        return true;
    }
    return false;
}

const Buffer& buffer(const CallFrame* frame, bool ret, int64_t i, const char* name) {
    const int64_t size = ret ? frame->rets.size : frame->args.size;
    if (i >= size) throw std::invalid_argument(std::string("missing buffer ") + name);
    const int type = ret ? int(frame->rets.types[i]) : int(frame->args.types[i]);
    if (type != 1) throw std::invalid_argument(std::string(name) + " is not a buffer");
    const auto* b = static_cast<const Buffer*>(ret ? frame->rets.rets[i] : frame->args.args[i]);
    if (b->dtype != kF32) {
        throw std::invalid_argument(std::string(name) + " must be float32 (XLA dtype code " +
                                    std::to_string(int(b->dtype)) + ")");
    }
    return *b;
}

const Scalar& attribute(const CallFrame* frame, std::string_view name) {
    for (int64_t i = 0; i < frame->attrs.size; ++i) {
        const ByteSpan* n = frame->attrs.names[i];
        if (std::string_view(n->ptr, n->len) != name) continue;
        if (frame->attrs.types[i] != kAttrScalar) break;
        return *static_cast<const Scalar*>(frame->attrs.attrs[i]);
    }
    throw std::invalid_argument("missing scalar attribute " + std::string(name));
}

int64_t int_attribute(const CallFrame* frame, std::string_view name) {
    const Scalar& s = attribute(frame, name);
    switch (s.dtype) {
        case kPred: return *static_cast<const bool*>(s.value) ? 1 : 0;
        case kS32: return *static_cast<const int32_t*>(s.value);
        case kS64: return *static_cast<const int64_t*>(s.value);
        default: throw std::invalid_argument("attribute " + std::string(name) + " must be an int");
    }
}

double float_attribute(const CallFrame* frame, std::string_view name) {
    const Scalar& s = attribute(frame, name);
    switch (s.dtype) {
        case kF32: return *static_cast<const float*>(s.value);
        case kF64: return *static_cast<const double*>(s.value);
        default: throw std::invalid_argument("attribute " + std::string(name) + " must be a float");
    }
}

AttentionOptions options_of(const CallFrame* frame) {
    AttentionOptions opt;
    opt.causal = int_attribute(frame, "causal") != 0;
    opt.window_left = int_attribute(frame, "window_left");
    opt.window_right = int_attribute(frame, "window_right");
    opt.scale = float_attribute(frame, "scale");
    return opt;
}

std::string dims_string(const Buffer& b) {
    return shape_string(std::vector<int64_t>(b.dims, b.dims + b.rank));
}

// b as a dense 4-D (or, with `trailing` = 2, 3-D) view: the axes before its
// last `trailing` + 1 are folded into the first; they must equal `lead`.
TensorView view_of(const Buffer& b, const char* name, int trailing,
                   const std::vector<int64_t>& lead) {
    const int64_t n_lead = int64_t(lead.size());
    if (b.rank != n_lead + trailing ||
        !std::equal(lead.begin(), lead.end(), b.dims)) {
        throw std::invalid_argument(std::string(name) + " has shape " + dims_string(b) +
                                    ", whose leading axes do not match q's");
    }
    int64_t batch = 1;
    for (int64_t d : lead) batch *= d;
    TensorView t;
    t.data = b.data;  // float32: buffer() checks the element type
    t.shape.push_back(batch);
    for (int64_t i = n_lead; i < b.rank; ++i) t.shape.push_back(b.dims[i]);
    t.strides.assign(t.shape.size(), 1);
    for (int64_t i = int64_t(t.shape.size()) - 2; i >= 0; --i) {
        t.strides[size_t(i)] = t.strides[size_t(i) + 1] * t.shape[size_t(i) + 1];
    }
    return t;
}

// q's axes before (Tq, H, D): B, and any that vmap added.
std::vector<int64_t> leading_axes(const Buffer& q) {
    if (q.rank < 4) {
        throw std::invalid_argument("q must have at least 4 dimensions (B, Tq, H, D), got " +
                                    dims_string(q));
    }
    return std::vector<int64_t>(q.dims, q.dims + (q.rank - 3));
}

void check_output(const TensorView& out, const std::vector<int64_t>& expected, const char* name) {
    if (out.shape != expected) {
        throw std::invalid_argument(std::string(name) + " has shape " + shape_string(out.shape) +
                                    ", expected " + shape_string(expected));
    }
}

template <class Body>
xla_ffi::Error* guarded(CallFrame* frame, const char* fn, Body body) {
    try {
        if (answer_metadata(frame)) return nullptr;
        body();
        return nullptr;
    } catch (const std::invalid_argument& e) {
        return make_error(frame, kInvalidArgument, std::string(fn) + ": " + e.what());
    } catch (const std::bad_alloc&) {
        return make_error(frame, kResourceExhausted, std::string(fn) + ": out of memory");
    } catch (const std::exception& e) {
        return make_error(frame, kInternal, std::string(fn) + ": " + e.what());
    }
}

}  // namespace

// args: q, k, v; rets: o, lse.
xla_ffi::Error* xla_attention_forward(xla_ffi::CallFrame* frame) {
    return guarded(frame, "flashattn.jax", [&] {
        const std::vector<int64_t> lead = leading_axes(buffer(frame, false, 0, "q"));
        const TensorView q = view_of(buffer(frame, false, 0, "q"), "q", 3, lead);
        const TensorView k = view_of(buffer(frame, false, 1, "k"), "k", 3, lead);
        const TensorView v = view_of(buffer(frame, false, 2, "v"), "v", 3, lead);
        const TensorView o = view_of(buffer(frame, true, 0, "o"), "o", 3, lead);
        const TensorView lse = view_of(buffer(frame, true, 1, "lse"), "lse", 2, lead);
        const FlashParams p = make_forward_params(q, k, v, options_of(frame));
        check_output(o, q.shape, "o");
        check_output(lse, {p.B, p.H, p.Tq}, "lse");
        run_forward(get_engine("cpu"), p,
                    {q.data, k.data, v.data, const_cast<void*>(o.data),
                     static_cast<float*>(const_cast<void*>(lse.data))});
    });
}

// args: do, q, k, v, o, lse; rets: dq, dk, dv.
xla_ffi::Error* xla_attention_backward(xla_ffi::CallFrame* frame) {
    return guarded(frame, "flashattn.jax (backward)", [&] {
        const std::vector<int64_t> lead = leading_axes(buffer(frame, false, 1, "q"));
        const TensorView dout = view_of(buffer(frame, false, 0, "do"), "do", 3, lead);
        const TensorView q = view_of(buffer(frame, false, 1, "q"), "q", 3, lead);
        const TensorView k = view_of(buffer(frame, false, 2, "k"), "k", 3, lead);
        const TensorView v = view_of(buffer(frame, false, 3, "v"), "v", 3, lead);
        const TensorView o = view_of(buffer(frame, false, 4, "o"), "o", 3, lead);
        const TensorView lse = view_of(buffer(frame, false, 5, "lse"), "lse", 2, lead);
        const TensorView dq = view_of(buffer(frame, true, 0, "dq"), "dq", 3, lead);
        const TensorView dk = view_of(buffer(frame, true, 1, "dk"), "dk", 3, lead);
        const TensorView dv = view_of(buffer(frame, true, 2, "dv"), "dv", 3, lead);
        const FlashParams p = make_backward_params(dout, q, k, v, o, lse, options_of(frame));
        check_output(dq, q.shape, "dq");
        check_output(dk, k.shape, "dk");
        check_output(dv, v.shape, "dv");
        run_backward(get_engine("cpu"), p,
                     {dout.data, q.data, k.data, v.data, o.data,
                      static_cast<const float*>(lse.data), const_cast<void*>(dq.data),
                      const_cast<void*>(dk.data), const_cast<void*>(dv.data)});
    });
}

}  // namespace flashattn
