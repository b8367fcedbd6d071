// The Metal device object: finds the device and the metallib built with the
// extension, checks the device can run the kernels, caches compute pipelines,
// and executes a Plan as command buffers of bounded work (core/chunks.h).
// Every nil, NSError and command-buffer status becomes a std::runtime_error
// carrying Metal's own message and error code.
#import <Foundation/Foundation.h>
#import <IOKit/IOKitLib.h>
#import <Metal/Metal.h>

#include "metal/device.h"

#include "core/chunks.h"
#include "core/interrupt.h"
#include "core/selftest.h"
#include "metal/command_buffer_error.h"
#include "metal/pipeline_key.h"

#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
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

// The highest Apple GPU family the device supports ("Apple7" for M1), or
// "not an Apple GPU family (Mac2 only)".
std::string gpu_family(id<MTLDevice> device) {
    const struct {
        MTLGPUFamily family;
        const char* name;
    } families[] = {
        {MTLGPUFamilyApple9, "Apple9"}, {MTLGPUFamilyApple8, "Apple8"},
        {MTLGPUFamilyApple7, "Apple7"}, {MTLGPUFamilyApple6, "Apple6"},
        {MTLGPUFamilyApple5, "Apple5"}, {MTLGPUFamilyApple4, "Apple4"},
        {MTLGPUFamilyApple3, "Apple3"}, {MTLGPUFamilyApple2, "Apple2"},
        {MTLGPUFamilyApple1, "Apple1"},
    };
    for (const auto& f : families)
        if ([device supportsFamily:f.family]) return f.name;
    return "not an Apple GPU family";
}

const char* command_buffer_error_name(NSInteger code) {
    switch (code) {
        case MTLCommandBufferErrorNone: return "MTLCommandBufferErrorNone";
        case MTLCommandBufferErrorInternal: return "MTLCommandBufferErrorInternal";
        case MTLCommandBufferErrorTimeout: return "MTLCommandBufferErrorTimeout";
        case MTLCommandBufferErrorPageFault: return "MTLCommandBufferErrorPageFault";
        case MTLCommandBufferErrorAccessRevoked: return "MTLCommandBufferErrorAccessRevoked";
        case MTLCommandBufferErrorNotPermitted: return "MTLCommandBufferErrorNotPermitted";
        case MTLCommandBufferErrorOutOfMemory: return "MTLCommandBufferErrorOutOfMemory";
        case MTLCommandBufferErrorInvalidResource: return "MTLCommandBufferErrorInvalidResource";
        case MTLCommandBufferErrorMemoryless: return "MTLCommandBufferErrorMemoryless";
        case MTLCommandBufferErrorDeviceRemoved: return "MTLCommandBufferErrorDeviceRemoved";
        case MTLCommandBufferErrorStackOverflow: return "MTLCommandBufferErrorStackOverflow";
        default: return "MTLCommandBufferError (unknown code)";
    }
}

const char* encoder_state_name(MTLCommandEncoderErrorState state) {
    switch (state) {
        case MTLCommandEncoderErrorStateUnknown: return "unknown";
        case MTLCommandEncoderErrorStateCompleted: return "completed";
        case MTLCommandEncoderErrorStateAffected: return "affected";
        case MTLCommandEncoderErrorStatePending: return "pending";
        case MTLCommandEncoderErrorStateFaulted: return "faulted";
    }
    return "?";
}

static_assert(MTLCommandBufferErrorTimeout == kCommandBufferErrorTimeout,
              "command_buffer_error.h's timeout code must be Metal's");

// Every description an NSError carries: its own and its underlying errors'
// (NSUnderlyingErrorKey), joined with "; ". The "Impacting Interactivity"
// kill is known only by such text (command_buffer_error.h).
std::string all_descriptions(NSError* error) {
    std::string text;
    for (int depth = 0; error && depth < 8; ++depth) {
        if (!text.empty()) text += "; ";
        text += describe(error);
        id underlying = error.userInfo[NSUnderlyingErrorKey];
        error = [underlying isKindOfClass:[NSError class]] ? (NSError*)underlying : nil;
    }
    return text;
}

// "MTLCommandBufferErrorTimeout (code 2): <the device's message>; encoders:
// <label> faulted, ...", and the watchdog hint after a timeout or an
// "Impacting Interactivity" kill (command_buffer_error.h decides which).
std::string describe_command_buffer_error(id<MTLCommandBuffer> commands) {
    NSError* error = commands.error;
    if (!error) return "status " + std::to_string(long(commands.status)) + ", no error information";
    const std::string descriptions = all_descriptions(error);
    std::string text = std::string(command_buffer_error_name(error.code)) + " (code " +
                       std::to_string(long(error.code)) + "): " + descriptions;
    NSArray* infos = error.userInfo[MTLCommandBufferEncoderInfoErrorKey];
    if ([infos isKindOfClass:[NSArray class]] && infos.count > 0) {
        text += "; encoders:";
        for (id<MTLCommandBufferEncoderInfo> info in infos)
            text += std::string(" ") + (info.label ? info.label.UTF8String : "?") + " " +
                    encoder_state_name(info.errorState);
    }
    return text + command_buffer_hint_text(long(error.code), descriptions);
}

MTLSize size_of(const Dim3& d) { return MTLSizeMake(d.x, d.y, d.z); }

// The GPU core count the system reports: "gpu-core-count" of the device's
// IORegistry entry (the AGXAccelerator service; searched up its parents), 0
// when it has none.
int registry_gpu_cores(id<MTLDevice> device) {
    io_service_t service =
        IOServiceGetMatchingService(kIOMainPortDefault, IORegistryEntryIDMatching(device.registryID));
    if (service == IO_OBJECT_NULL) return 0;
    int cores = 0;
    CFTypeRef value = IORegistryEntrySearchCFProperty(
        service, kIOServicePlane, CFSTR("gpu-core-count"), kCFAllocatorDefault,
        kIORegistryIterateRecursively | kIORegistryIterateParents);
    if (value) {
        if (CFGetTypeID(value) == CFNumberGetTypeID())
            CFNumberGetValue(static_cast<CFNumberRef>(value), kCFNumberIntType, &cores);
        CFRelease(value);
    }
    IOObjectRelease(service);
    return cores;
}

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
        // simdgroup_matrix needs Apple7 (M1, A14) or later. GitHub's hosted
        // arm64 runners expose a paravirtual Apple5 GPU without it.
        if (![device supportsFamily:MTLGPUFamilyApple7])
            throw std::runtime_error("metal: the GPU '" + std::string(device.name.UTF8String) +
                                     "' is GPU family " + gpu_family(device) +
                                     "; the kernels need Apple7 or later (simdgroup matrices: "
                                     "M1 and newer)");
        id<MTLCommandQueue> queue = [device newCommandQueue];
        if (!queue) throw std::runtime_error("metal: could not create a command queue on " +
                                             std::string(device.name.UTF8String));
        id<MTLLibrary> library = load_library(device);
        // Zero-filled (newBufferWithLength clears it); its base is page
        // aligned, so offset 0 is 16-byte aligned.
        id<MTLBuffer> unused_slot = [device newBufferWithLength:kUnusedSlotBytes
                                                        options:MTLResourceStorageModeShared];
        if (!unused_slot)
            throw std::runtime_error("metal: could not allocate the " +
                                     std::to_string(kUnusedSlotBytes) + "-byte buffer for unused "
                                     "argument slots on " + std::string(device.name.UTF8String));
        // The GPU's class and core count, as the plan sizes split-KV decode
        // for it (core/gpu_info.h).
        const std::string architecture =
            device.architecture.name ? std::string(device.architecture.name.UTF8String) : "";
        const GpuInfo gpu = gpu_info_from(registry_gpu_cores(device), architecture);
        return std::unique_ptr<Device>(new Device(device, queue, library, unused_slot, architecture, gpu));
    }
}

std::string Device::name() const {
    @autoreleasepool {
        return std::string(device_.name.UTF8String);
    }
}

void with_autorelease_pool(const std::function<void()>& f) {
    std::exception_ptr failure;
    @autoreleasepool {
        try {
            f();
        } catch (...) {
            failure = std::current_exception();
        }
    }
    if (failure) std::rethrow_exception(failure);
}

id<MTLCommandQueue> Device::queue() {
    std::lock_guard<std::mutex> lock(queue_mu_);
    return queue_;
}

// A queue whose command buffer failed may ignore later work: start a new one
// (once, if several calls saw the same failure).
void Device::replace_queue(id<MTLCommandQueue> failed) {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (queue_ != failed) return;
    id<MTLCommandQueue> fresh = [device_ newCommandQueue];
    if (fresh) queue_ = fresh;
}

id<MTLComputePipelineState> Device::pipeline(const std::string& kernel,
                                             const std::vector<FunctionConstant>& constants) {
    const std::string key = pipeline_key(kernel, constants);
    {
        std::shared_lock<std::shared_mutex> lock(pipelines_mu_);
        if (auto it = pipelines_.find(key); it != pipelines_.end()) return it->second;
    }
    // Compiled with no lock held: a compile can take a while, and other
    // threads' look-ups (of pipelines already built) must not wait behind it.
    // Two threads that miss the same key both compile it; the first inserted
    // is kept, so every caller gets the same pipeline object.
    id<MTLComputePipelineState> built = build_pipeline(kernel, key, constants);
    std::unique_lock<std::shared_mutex> lock(pipelines_mu_);
    return pipelines_.try_emplace(key, built).first->second;
}

// The pipeline for `kernel` with `constants` (cached under `key`), or a
// std::runtime_error naming the kernel and Metal's reason.
id<MTLComputePipelineState> Device::build_pipeline(const std::string& kernel, const std::string& key,
                                                   const std::vector<FunctionConstant>& constants) {
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
        // A kernel that declares [[max_total_threads_per_threadgroup(N)]] is
        // built for exactly N threads (the compiler may then give each thread
        // more registers); a limit below N would fail the plan's launches.
        const uint32_t declared = declared_max_threads(kernel);
        if (function && declared) {
            MTLComputePipelineDescriptor* descriptor = [[MTLComputePipelineDescriptor alloc] init];
            descriptor.computeFunction = function;
            descriptor.maxTotalThreadsPerThreadgroup = declared;
            descriptor.label = name;
            state = [device_ newComputePipelineStateWithDescriptor:descriptor
                                                           options:MTLPipelineOptionNone
                                                        reflection:nil
                                                             error:&error];
            if (!state) {
                failure = describe(error);
            } else if (state.maxTotalThreadsPerThreadgroup < declared) {
                failure = "this device gives it at most " +
                          std::to_string(state.maxTotalThreadsPerThreadgroup) +
                          " threads per threadgroup, below the " + std::to_string(declared) +
                          " it declares (max_total_threads_per_threadgroup): its registers or "
                          "threadgroup memory do not fit that many threads";
                state = nil;
            }
        } else if (function) {
            state = [device_ newComputePipelineStateWithFunction:function error:&error];
            if (!state) failure = describe(error);
        }
    }
    if (!state) throw std::runtime_error("metal: cannot create the pipeline for kernel '" + key +
                                         "': " + failure);
    return state;
}

std::vector<float> Device::run_lane_probe() {
    std::vector<float> out(kLaneProbeOutputs, std::nanf(""));
    with_autorelease_pool([&] {
        const Launch launch = lane_probe_launch();
        id<MTLComputePipelineState> state = pipeline(launch.kernel, launch.constants);
        const std::vector<float> in = lane_probe_input();
        id<MTLBuffer> input = [device_ newBufferWithBytes:in.data()
                                                   length:in.size() * sizeof(float)
                                                  options:MTLResourceStorageModeShared];
        id<MTLBuffer> output = [device_ newBufferWithLength:out.size() * sizeof(float)
                                                    options:MTLResourceStorageModeShared];
        if (!input || !output) throw std::runtime_error("metal: could not allocate the lane probe's buffers");
        id<MTLCommandQueue> queue = this->queue();
        id<MTLCommandBuffer> commands = [queue commandBuffer];
        id<MTLComputeCommandEncoder> encoder = [commands computeCommandEncoder];
        if (!commands || !encoder) throw std::runtime_error("metal: could not encode the lane probe");
        [encoder setComputePipelineState:state];
        [encoder setBuffer:input offset:0 atIndex:0];
        [encoder setBuffer:output offset:0 atIndex:1];
        [encoder dispatchThreadgroups:size_of(launch.grid) threadsPerThreadgroup:size_of(launch.threadgroup)];
        [encoder endEncoding];
        [commands commit];
        [commands waitUntilCompleted];
        if (commands.status != MTLCommandBufferStatusCompleted) {
            replace_queue(queue);
            throw std::runtime_error("metal: the lane probe's command buffer failed: " +
                                     describe_command_buffer_error(commands));
        }
        std::memcpy(out.data(), output.contents, out.size() * sizeof(float));
    });
    return out;
}

void Device::execute(const Plan& plan, const Call& call) {
    // Resolve and check everything before encoding, so that no error leaves an
    // encoder open (the validation layer treats that as fatal).
    std::vector<id<MTLComputePipelineState>> pipelines(plan.launches.size(), nil);
    for (size_t i = 0; i < plan.launches.size(); ++i) {
        const Launch& launch = plan.launches[i];
        if (uint64_t(launch.grid.x) * launch.grid.y * launch.grid.z == 0) continue;  // no work
        id<MTLComputePipelineState> state = pipeline(launch.kernel, launch.constants);
        const uint64_t threads =
            uint64_t(launch.threadgroup.x) * launch.threadgroup.y * launch.threadgroup.z;
        if (threads == 0 || threads > state.maxTotalThreadsPerThreadgroup)
            throw std::runtime_error(
                "metal: kernel '" + launch.kernel + "' asks for " + std::to_string(threads) +
                " threads per threadgroup; this device allows " +
                std::to_string(state.maxTotalThreadsPerThreadgroup) + " for it");
        for (size_t index = 0; index < launch.buffers.size(); ++index)
            if (launch.buffers[index] != Slot::params && launch.buffers[index] != Slot::score)
                (void)call.buffer_for(launch, index);  // throws when the call has no buffer there
        pipelines[i] = state;
    }
    const Schedule schedule = schedule_plan(plan, work_model_from_env());
    if (schedule.pieces.empty()) return;

    auto piece_name = [&](const Piece& piece) {
        return plan.launches[piece.launch].kernel + " at (" + std::to_string(piece.origin.x) +
               "," + std::to_string(piece.origin.y) + "," + std::to_string(piece.origin.z) +
               ") x (" + std::to_string(piece.grid.x) + "," + std::to_string(piece.grid.y) +
               "," + std::to_string(piece.grid.z) + ")";
    };

    id<MTLCommandQueue> queue = this->queue();
    with_autorelease_pool([&] {
        std::vector<id<MTLCommandBuffer>> committed;
        // Never leave with work in flight: it reads the call's buffers,
        // including host arrays bound without a copy.
        auto wait_all = [&] {
            for (id<MTLCommandBuffer> c : committed) [c waitUntilCompleted];
        };
        const size_t n_buffers = schedule.command_buffers.size();
        try {
        for (size_t b = 0; b < n_buffers; ++b) {
            // Two command buffers in flight keep the GPU fed; waiting for the
            // older one before the next gives Ctrl-C (core/interrupt.h) a
            // chance between buffers instead of after the whole call.
            if (b >= 2) [committed[b - 2] waitUntilCompleted];
            throw_if_interrupted();
            MTLCommandBufferDescriptor* descriptor = [[MTLCommandBufferDescriptor alloc] init];
            descriptor.errorOptions = MTLCommandBufferErrorOptionEncoderExecutionStatus;
            id<MTLCommandBuffer> commands = [queue commandBufferWithDescriptor:descriptor];
            if (!commands) throw std::runtime_error("metal: could not create a command buffer");
            id<MTLComputeCommandEncoder> encoder = [commands computeCommandEncoder];
            if (!encoder) throw std::runtime_error("metal: could not create a compute encoder");
            encoder.label = [NSString stringWithUTF8String:piece_name(schedule.pieces[schedule.command_buffers[b]]).c_str()];
            for (size_t i = schedule.command_buffers[b]; i < schedule.end_of_buffer(b); ++i) {
                const Piece& piece = schedule.pieces[i];
                const Launch& launch = plan.launches[piece.launch];
                // The piece's origin, added by the kernels to their threadgroup position.
                const FlashParams params = params_for_piece(plan.params, piece);
                [encoder setComputePipelineState:pipelines[piece.launch]];
                for (size_t index = 0; index < launch.buffers.size(); ++index) {
                    const Slot slot = launch.buffers[index];
                    if (slot == Slot::params) {
                        [encoder setBytes:&params length:sizeof(FlashParams) atIndex:index];
                    } else if (slot == Slot::score) {
                        [encoder setBytes:&plan.score length:sizeof(FlashScoreParams) atIndex:index];
                    } else {
                        // A score array the call does not use gets the
                        // dedicated unused-slot buffer (staging.h, buffer_for).
                        const Call::Binding& bound = call.buffer_for(launch, index);
                        if (bound.unused)
                            [encoder setBuffer:unused_slot_ offset:0 atIndex:index];
                        else
                            [encoder setBuffer:bound.handle offset:bound.offset atIndex:index];
                    }
                }
                // Serial dispatch (the default encoder): each launch sees the
                // previous one's writes; buffers run in order on the queue.
                [encoder dispatchThreadgroups:size_of(piece.grid)
                        threadsPerThreadgroup:size_of(launch.threadgroup)];
            }
            [encoder endEncoding];
            [commands commit];
            committed.push_back(commands);
        }
        } catch (...) {
            wait_all();
            throw;
        }
        wait_all();
        for (size_t b = 0; b < committed.size(); ++b) {
            id<MTLCommandBuffer> commands = committed[b];
            if (commands.status == MTLCommandBufferStatusCompleted) continue;
            const Piece& first = schedule.pieces[schedule.command_buffers[b]];
            const Piece& last = schedule.pieces[schedule.end_of_buffer(b) - 1];
            replace_queue(queue);
            throw std::runtime_error(
                "metal: command buffer " + std::to_string(b + 1) + " of " +
                std::to_string(committed.size()) + " failed (pieces " + piece_name(first) +
                (&first == &last ? std::string() : " .. " + piece_name(last)) +
                "): " + describe_command_buffer_error(commands));
        }
    });
}

}  // namespace flashattn::metal
