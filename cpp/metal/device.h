// The Metal device object (device, command queue, the build-time metallib, the
// pipeline cache) and the plan executor. Objective-C++ only: included by the
// .mm files of cpp/metal, never by a C++ translation unit.
#pragma once
#ifndef __OBJC__
#error "cpp/metal/device.h uses Metal types: include it only from Objective-C++ (.mm) files"
#endif

#import <Metal/Metal.h>

#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/plan.h"
#include "metal/buffer_pool.h"
#include "metal/staging.h"

namespace flashattn::metal {

// Pool buffers are MTLBuffers in shared storage: on unified memory the CPU
// address NumPy sees is the memory the GPU reads.
struct MetalBackend {
    using Handle = id<MTLBuffer>;
    id<MTLDevice> device;

    Handle allocate(size_t bytes) const {
        // Past the device's limit Metal's validation layer aborts instead of
        // returning nil: refuse here, and the pool raises OutOfMemory.
        if (bytes > device.maxBufferLength) return nil;
        return [device newBufferWithLength:bytes options:MTLResourceStorageModeShared];
    }
    void* contents(const Handle& buffer) const { return buffer.contents; }
};

using Pool = BufferPool<MetalBackend>;
using Call = CallBuffers<Pool>;

class Device {
public:
    // nullptr when this machine has no Metal device; throws std::runtime_error
    // (naming every path tried) when the metallib cannot be loaded.
    static std::unique_ptr<Device> create_default();

    id<MTLDevice> device() const { return device_; }
    std::string name() const;

    // Created once per kernel name and constant values, then cached.
    id<MTLComputePipelineState> pipeline(const std::string& kernel,
                                         const std::vector<FunctionConstant>& constants = {});

    // Encodes every launch of the plan with the call's buffers, commits,
    // waits, and throws std::runtime_error with Metal's message on failure.
    void execute(const Plan& plan, const Call& call);

private:
    Device(id<MTLDevice> device, id<MTLCommandQueue> queue, id<MTLLibrary> library)
        : device_(device), queue_(queue), library_(library) {}

    id<MTLDevice> device_;
    id<MTLCommandQueue> queue_;
    id<MTLLibrary> library_;
    std::shared_mutex pipelines_mu_;
    std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

// Where the metallib is looked for, in order: $FLASHATTN_METALLIB alone when
// set, else flashattn.metallib beside the binary this code is linked into.
std::vector<std::string> metallib_candidates();

}  // namespace flashattn::metal
