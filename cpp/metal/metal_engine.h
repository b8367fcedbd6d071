// The metal engine as plain C++ sees it (no Objective-C, no Metal types):
// the Engine interface plus the pool controls the Python bindings expose.
// Implemented in cpp/metal/engine.mm; created by make_metal_engine().
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "core/engine.h"
#include "core/plan.h"
#include "metal/buffer_pool.h"
#include "metal/staging.h"

namespace flashattn::metal {

class MetalEngine : public Engine {
public:
    // Pool buffers of `bytes` (fa.empty): shared storage, page aligned; the
    // owner returns the buffer to the pool. Arrays in them are used in place.
    virtual OutputBuffer allocate_bytes(size_t bytes) = 0;

    // Whether [p, p + bytes) lies inside one pool buffer that is handed out.
    virtual bool owns(const void* p, size_t bytes) const = 0;

    virtual std::string device_name() const = 0;
    // The GPU as the engine's plans see it (core/gpu_info.h): the in-stream
    // paths plan with it too, so that both size split-KV alike.
    virtual GpuInfo gpu() const = 0;
    virtual PoolStats pool_stats() const = 0;
    virtual TransferStats transfer_stats() const = 0;
    virtual void clear_cache() = 0;
    virtual size_t set_cache_limit(size_t bytes) = 0;  // returns the previous limit
};

}  // namespace flashattn::metal
