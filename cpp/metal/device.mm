// The Metal device object: finds the device and the metallib built with the
// extension, caches compute pipelines, and executes a Plan (encode every
// launch, commit, wait, check). Every nil, NSError and command-buffer status
// becomes a std::runtime_error carrying Metal's own message.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include "metal/device.h"

#include <dlfcn.h>

#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>

namespace flashattn::metal {
namespace {

std::string describe(NSError* error) {
    if (!error) return "no error information";
    NSString* text = error.localizedDescription;
    return text ? std::string(text.UTF8String) : std::string("error ") + std::to_string(error.code);
}

std::string directory_of(const std::string& path) {
    const size_t slash = path.find_last_of('/');
    return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

// The binary (extension module or test program) this code is linked into:
// the metallib is installed beside it.
std::string this_binary() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<const void*>(&metallib_candidates), &info) && info.dli_fname)
        return info.dli_fname;
    return {};
}

id<MTLLibrary> load_library(id<MTLDevice> device) {
    std::string tried;
    for (const std::string& path : metallib_candidates()) {
        NSString* ns_path = [NSString stringWithUTF8String:path.c_str()];
        if (!ns_path || ![[NSFileManager defaultManager] fileExistsAtPath:ns_path]) {
            tried += "\n  " + path + " (not found)";
            continue;
        }
        NSError* error = nil;
        id<MTLLibrary> library = [device newLibraryWithURL:[NSURL fileURLWithPath:ns_path]
                                                     error:&error];
        if (library) return library;
        tried += "\n  " + path + " (" + describe(error) + ")";
    }
    throw std::runtime_error(
        "metal: cannot load flashattn.metallib (it is built with the extension and installed "
        "beside it; set FLASHATTN_METALLIB to its path to override). Tried:" + tried);
}

std::string pipeline_key(const std::string& kernel, const std::vector<FunctionConstant>& constants) {
    std::string key = kernel;
    for (const FunctionConstant& c : constants) {
        // Exact bits: two different floats never share a pipeline.
        key += "|" + std::to_string(c.index) + ":" + std::to_string(int(c.type)) + "=" +
               std::to_string(c.bits);
    }
    return key;
}

MTLSize size_of(const Dim3& d) { return MTLSizeMake(d.x, d.y, d.z); }

}  // namespace

std::vector<std::string> metallib_candidates() {
    if (const char* override_path = std::getenv("FLASHATTN_METALLIB");
        override_path && *override_path)
        return {override_path};
    std::vector<std::string> paths;
    const std::string binary = this_binary();
    if (!binary.empty()) paths.push_back(directory_of(binary) + "/flashattn.metallib");
    else paths.push_back("<dladdr could not locate the flashattn binary>/flashattn.metallib");
    return paths;
}

std::unique_ptr<Device> Device::create_default() {
    @autoreleasepool {
        id<MTLDevice> device = MTLCreateSystemDefaultDevice();
        if (!device) return nullptr;
        id<MTLCommandQueue> queue = [device newCommandQueue];
        if (!queue) throw std::runtime_error("metal: could not create a command queue on " +
                                             std::string(device.name.UTF8String));
        id<MTLLibrary> library = load_library(device);
        return std::unique_ptr<Device>(new Device(device, queue, library));
    }
}

std::string Device::name() const { return std::string(device_.name.UTF8String); }

id<MTLComputePipelineState> Device::pipeline(const std::string& kernel,
                                             const std::vector<FunctionConstant>& constants) {
    const std::string key = pipeline_key(kernel, constants);
    {
        std::shared_lock<std::shared_mutex> lock(pipelines_mu_);
        if (auto it = pipelines_.find(key); it != pipelines_.end()) return it->second;
    }
    std::unique_lock<std::shared_mutex> lock(pipelines_mu_);
    // Another thread may have created it between the two locks.
    if (auto it = pipelines_.find(key); it != pipelines_.end()) return it->second;

    id<MTLComputePipelineState> state = nil;
    std::string failure;
    @autoreleasepool {
        NSString* name = [NSString stringWithUTF8String:kernel.c_str()];
        NSError* error = nil;
        id<MTLFunction> function = nil;
        if (constants.empty()) {
            function = [library_ newFunctionWithName:name];
            if (!function) failure = "no function of that name in flashattn.metallib";
        } else {
            MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
            for (const FunctionConstant& c : constants) {
                const bool b = c.bits != 0;
                switch (c.type) {
                    case FunctionConstant::Type::boolean:
                        [values setConstantValue:&b type:MTLDataTypeBool atIndex:c.index];
                        break;
                    case FunctionConstant::Type::int32:
                        [values setConstantValue:&c.bits type:MTLDataTypeInt atIndex:c.index];
                        break;
                    case FunctionConstant::Type::float32:
                        [values setConstantValue:&c.bits type:MTLDataTypeFloat atIndex:c.index];
                        break;
                }
            }
            function = [library_ newFunctionWithName:name constantValues:values error:&error];
            if (!function) failure = describe(error);
        }
        if (function) {
            state = [device_ newComputePipelineStateWithFunction:function error:&error];
            if (!state) failure = describe(error);
        }
    }
    if (!state) throw std::runtime_error("metal: cannot create the pipeline for kernel '" + key +
                                         "': " + failure);
    pipelines_.emplace(key, state);
    return state;
}

void Device::execute(const Plan& plan, const Call& call) {
    // Resolve and check everything before encoding, so that no error leaves an
    // encoder open (the validation layer treats that as fatal).
    struct Step {
        const Launch* launch;
        id<MTLComputePipelineState> pipeline;
    };
    std::vector<Step> steps;
    for (const Launch& launch : plan.launches) {
        if (uint64_t(launch.grid.x) * launch.grid.y * launch.grid.z == 0) continue;  // no work
        id<MTLComputePipelineState> state = pipeline(launch.kernel, launch.constants);
        const uint64_t threads =
            uint64_t(launch.threadgroup.x) * launch.threadgroup.y * launch.threadgroup.z;
        if (threads == 0 || threads > state.maxTotalThreadsPerThreadgroup)
            throw std::runtime_error(
                "metal: kernel '" + launch.kernel + "' asks for " + std::to_string(threads) +
                " threads per threadgroup; this device allows " +
                std::to_string(state.maxTotalThreadsPerThreadgroup) + " for it");
        for (const Slot slot : launch.buffers)
            if (slot != Slot::params && !call.binding(slot).bound)
                throw std::runtime_error("metal: kernel '" + launch.kernel + "' binds '" +
                                         slot_name(slot) + "', which this call has no buffer for");
        steps.push_back({&launch, state});
    }
    if (steps.empty()) return;

    std::exception_ptr failure;  // thrown after the autorelease pool has drained
    @autoreleasepool {
        try {
            MTLCommandBufferDescriptor* descriptor = [[MTLCommandBufferDescriptor alloc] init];
            descriptor.errorOptions = MTLCommandBufferErrorOptionEncoderExecutionStatus;
            id<MTLCommandBuffer> commands = [queue_ commandBufferWithDescriptor:descriptor];
            if (!commands) throw std::runtime_error("metal: could not create a command buffer");
            id<MTLComputeCommandEncoder> encoder = [commands computeCommandEncoder];
            if (!encoder) throw std::runtime_error("metal: could not create a compute encoder");
            for (const Step& step : steps) {
                const Launch& launch = *step.launch;
                [encoder setComputePipelineState:step.pipeline];
                for (size_t index = 0; index < launch.buffers.size(); ++index) {
                    const Slot slot = launch.buffers[index];
                    if (slot == Slot::params) {
                        [encoder setBytes:&plan.params length:sizeof(FlashParams) atIndex:index];
                    } else {
                        const Call::Binding& b = call.binding(slot);
                        [encoder setBuffer:b.handle offset:b.offset atIndex:index];
                    }
                }
                // Serial dispatch (the default encoder): each launch sees the
                // previous one's writes.
                [encoder dispatchThreadgroups:size_of(launch.grid)
                        threadsPerThreadgroup:size_of(launch.threadgroup)];
            }
            [encoder endEncoding];
            [commands commit];
            [commands waitUntilCompleted];
            if (commands.status != MTLCommandBufferStatusCompleted) {
                const std::string kernels =
                    steps.size() == 1 ? steps[0].launch->kernel
                                      : steps.front().launch->kernel + " .. " +
                                            steps.back().launch->kernel;
                throw std::runtime_error("metal: command buffer failed (status " +
                                         std::to_string(long(commands.status)) + ", kernels " +
                                         kernels + "): " + describe(commands.error));
            }
        } catch (...) {
            failure = std::current_exception();
        }
    }
    if (failure) std::rethrow_exception(failure);
}

}  // namespace flashattn::metal
