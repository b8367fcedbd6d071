// The metal engine's pool in flashattn._core (Apple builds only): pool-backed
// byte buffers for fa.empty / fa.asarray, the check that an array lives in
// the pool, statistics, clear_cache and the cache limit. python/flashattn/
// memory.py wraps these; plain C++ here, the Objective-C stays in cpp/metal.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/registry.h"
#include "metal/metal_engine.h"

namespace nb = nanobind;

namespace flashattn {
namespace {

bool metal_available() {
    for (const std::string& name : available_engines())
        if (name == "metal") return true;
    return false;
}

metal::MetalEngine& metal_engine(const char* fn) {
    if (!metal_available())
        throw std::runtime_error(std::string(fn) +
                                 ": the metal engine is not available on this machine "
                                 "(no Metal device)");
    return dynamic_cast<metal::MetalEngine&>(get_engine("metal"));
}

nb::dict stats_dict(const metal::MetalEngine& engine) {
    const metal::PoolStats p = engine.pool_stats();
    const metal::TransferStats t = engine.transfer_stats();
    nb::dict d;
    d["device"] = engine.device_name();
    d["page_size"] = p.page_size;
    d["cache_limit"] = p.cache_limit;
    d["active_bytes"] = p.active_bytes;
    d["active_buffers"] = p.active_buffers;
    d["peak_active_bytes"] = p.peak_active_bytes;
    d["cached_bytes"] = p.cached_bytes;
    d["cached_buffers"] = p.cached_buffers;
    d["allocations"] = p.allocations;
    d["reuses"] = p.reuses;
    d["evictions"] = p.evictions;
    d["inputs_in_place"] = t.inputs_in_place;
    d["inputs_no_copy"] = t.inputs_no_copy;
    d["inputs_no_copy_bytes"] = t.inputs_no_copy_bytes;
    d["input_copies"] = t.input_copies;
    d["input_copy_bytes"] = t.input_copy_bytes;
    d["outputs_in_place"] = t.outputs_in_place;
    d["output_copies"] = t.output_copies;
    d["output_copy_bytes"] = t.output_copy_bytes;
    return d;
}

// A 1-D uint8 array of `nbytes` in a pool buffer; the capsule returns the
// buffer to the pool when the array (and every view of it) is gone.
nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> pool_bytes(size_t nbytes) {
    OutputBuffer buffer = metal_engine("empty").allocate_bytes(nbytes);
    auto* owner = new std::shared_ptr<void>(std::move(buffer.owner));
    nb::capsule capsule(owner, [](void* p) noexcept {
        delete static_cast<std::shared_ptr<void>*>(p);
    });
    const size_t shape[1] = {nbytes};
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(buffer.data, 1, shape, capsule);
}

}  // namespace

void bind_metal(nb::module_& m) {
    m.def("_metal_available", &metal_available,
          "Whether the metal engine runs on this machine.");
    m.def("_metal_empty", &pool_bytes, nb::arg("nbytes"),
          "A uint8 array of nbytes backed by a metal pool buffer.");
    m.def(
        "_metal_owns",
        [](uintptr_t address, size_t nbytes) {
            return metal_engine("asarray").owns(reinterpret_cast<const void*>(address), nbytes);
        },
        nb::arg("address"), nb::arg("nbytes"),
        "Whether [address, address + nbytes) lies in one pool buffer that is handed out.");
    m.def("_metal_gpu_cores", [] { return metal_engine("_metal_gpu_cores").gpu().cores; },
          "The GPU core count the metal engine plans for (core/gpu_info.h).");
    m.def("_metal_pool_stats", [] { return stats_dict(metal_engine("metal_pool_stats")); });
    m.def("_metal_clear_cache", [] { metal_engine("clear_cache").clear_cache(); });
    m.def(
        "_metal_set_cache_limit",
        [](size_t bytes) { return metal_engine("set_cache_limit").set_cache_limit(bytes); },
        nb::arg("bytes"));
}

}  // namespace flashattn
