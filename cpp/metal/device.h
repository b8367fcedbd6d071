// The Metal device object (device, command queue, the build-time metallib, the
// pipeline cache) and the plan executor. Objective-C++ only: included by the
// .mm files of cpp/metal, never by a C++ translation unit.
#pragma once
#ifndef __OBJC__
#error "cpp/metal/device.h uses Metal types: include it only from Objective-C++ (.mm) files"
#endif

#import <Metal/Metal.h>

#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/gpu_info.h"
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

    // Host memory bound in place (staging.h's no-copy path): `page` and `bytes`
    // are page aligned (BufferPool::wrap). No deallocator: the array belongs
    // to the caller, who keeps it alive for the call; the kernels only read it.
    Handle wrap(void* page, size_t bytes) const {
        if (bytes == 0 || bytes > device.maxBufferLength) return nil;
        return [device newBufferWithBytesNoCopy:page
                                         length:bytes
                                        options:MTLResourceStorageModeShared
                                    deallocator:nil];
    }
};

using Pool = BufferPool<MetalBackend>;
using Call = CallBuffers<Pool>;

// Runs f inside an autorelease pool (Objective-C called from Python threads,
// which have none) and rethrows its exception after the pool has drained.
void with_autorelease_pool(const std::function<void()>& f);

class Device {
public:
    // nullptr when this machine has no Metal device; throws std::runtime_error
    // when the metallib cannot be loaded (naming every path tried) or the
    // device cannot run the kernels (naming its GPU family: they need Apple7
    // or later, for simdgroup matrices; a paravirtual runner GPU is Apple5).
    static std::unique_ptr<Device> create_default();

    id<MTLDevice> device() const { return device_; }
    std::string name() const;
    // The GPU as the plan sizes for it (core/gpu_info.h), read once at creation.
    const GpuInfo& gpu() const { return gpu_; }
    // MTLDevice.architecture.name, e.g. "applegpu_g14d".
    const std::string& architecture() const { return architecture_; }

    // Created once per kernel name and constant values, then cached; the
    // compile runs outside the cache lock (a look-up never waits on it).
    id<MTLComputePipelineState> pipeline(const std::string& kernel,
                                         const std::vector<FunctionConstant>& constants = {});

    // The self-test's lane probe (core/selftest.h) on this GPU: what each
    // lane holds (kLaneProbeOutputs floats). Throws std::runtime_error when
    // the probe cannot run.
    std::vector<float> run_lane_probe();

    // Encodes the plan as command buffers of bounded work (core/chunks.h: each
    // launch's grid in pieces, each piece with its origin in a params copy),
    // commits them in order, waits, and throws std::runtime_error with the
    // MTLCommandBufferError code, the device's message and the failing
    // kernel piece. After a failure the command queue is recreated.
    void execute(const Plan& plan, const Call& call);

private:
    Device(id<MTLDevice> device, id<MTLCommandQueue> queue, id<MTLLibrary> library,
           id<MTLBuffer> unused_slot, std::string architecture, GpuInfo gpu)
        : device_(device), queue_(queue), library_(library), unused_slot_(unused_slot),
          architecture_(std::move(architecture)), gpu_(gpu) {}

    id<MTLComputePipelineState> build_pipeline(const std::string& kernel, const std::string& key,
                                               const std::vector<FunctionConstant>& constants);
    id<MTLCommandQueue> queue();
    void replace_queue(id<MTLCommandQueue> failed);

    id<MTLDevice> device_;
    std::mutex queue_mu_;
    id<MTLCommandQueue> queue_;  // replaced after a command buffer fails
    id<MTLLibrary> library_;
    // kUnusedSlotBytes of zeros, created once: what a launch's slots that the
    // call does not use are bound to (staging.h, Binding::unused). Only read
    // by no kernel, so calls on several threads may share it.
    id<MTLBuffer> unused_slot_;
    std::string architecture_;
    GpuInfo gpu_;
    std::shared_mutex pipelines_mu_;
    std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

// Where the metallib is looked for, in order: $FLASHATTN_METALLIB alone when
// set, else flashattn.metallib beside the binary this code is linked into.
std::vector<std::string> metallib_candidates();

}  // namespace flashattn::metal
