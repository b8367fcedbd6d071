// flashattn._core._xla_forward() / _xla_backward() / _xla_varlen_forward() /
// _xla_varlen_backward(): capsules holding the XLA FFI handlers' addresses, for jax.ffi.register_ffi_target(name, capsule,
// platform="cpu") in python/flashattn/jax.py.
#include <nanobind/nanobind.h>

#include "bindings/xla_handlers.h"

namespace flashattn {

void bind_xla_handlers(nanobind::module_& m) {
    m.def("_xla_forward", [] {
        return nanobind::capsule(reinterpret_cast<void*>(&xla_attention_forward));
    });
    m.def("_xla_backward", [] {
        return nanobind::capsule(reinterpret_cast<void*>(&xla_attention_backward));
    });
    m.def("_xla_varlen_forward", [] {
        return nanobind::capsule(reinterpret_cast<void*>(&xla_attention_varlen_forward));
    });
    m.def("_xla_varlen_backward", [] {
        return nanobind::capsule(reinterpret_cast<void*>(&xla_attention_varlen_backward));
    });
}

}  // namespace flashattn
