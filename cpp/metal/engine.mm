// The metal engine: binds a call's arrays, the score options' included, to
// pool buffers (in place or by one copy), turns the call into a Plan with
// the staged strides and score values (staging.h's run_staged_*) and has the
// device execute it. Outputs are pool buffers whose owner returns them to the pool.
#import <Metal/Metal.h>

#include <unistd.h>

#include <limits>
#include <mutex>
#include <new>

#include "core/score_arrays.h"
#include "core/selftest.h"
#include "engines/factories.h"
#include "metal/device.h"
#include "metal/metal_engine.h"

namespace flashattn {
namespace metal {
namespace {

class MetalEngineImpl final : public MetalEngine {
public:
    // The self-test (core/selftest.h), unless FLASHATTN_METAL_SELFTEST=0:
    // the lane probe now -- a failure keeps the engine from starting -- and
    // each pipeline's known-answer call at its first use, against a cpu
    // engine of its own.
    explicit MetalEngineImpl(std::unique_ptr<Device> device)
        : device_(std::move(device)),
          pool_(Pool::create(MetalBackend{device_->device()}, page_size(),
                             default_cache_limit(device_->device()))) {
        if (!selftest_enabled(true)) return;
        const std::string error = check_lane_probe(device_->run_lane_probe().data());
        if (!error.empty())
            throw std::runtime_error("metal engine self-test failed on '" + device_->name() +
                                     "' (" + device_->architecture() + "): " + error);
        selftest_ = std::make_unique<SelfTest>("metal", device_->gpu(), [this]() -> Engine& {
            std::call_once(reference_once_, [this] { reference_ = make_cpu_engine(); });
            return *reference_;
        });
    }

    std::string name() const override { return "metal"; }

    std::string unusable_reason() const override {
        return selftest_ ? selftest_->failure() : std::string();
    }
    SelfTest* selftest() const override { return selftest_.get(); }

    // The kernels apply every score option, both ways; Call stages their arrays.
    int score_mods_supported(bool) const override { return kEveryScoreMod; }

    // float32, float16 and bfloat16 kernels (shaders' FA_STORAGE_TYPES;
    // bfloat needs MSL 3.1, which the metallib is built for: macOS 14).
    bool dtype_supported(DType) const override { return true; }

    OutputBuffer allocate(size_t bytes) override { return allocate_bytes(bytes); }

    // Every entry point that calls Objective-C runs in an autorelease pool:
    // it is called from Python threads, which have none.
    OutputBuffer allocate_bytes(size_t bytes) override {
        std::shared_ptr<Pool::Lease> lease;
        with_autorelease_pool([&] { lease = pool_->acquire(bytes); });
        void* data = lease->data;
        return {data, std::shared_ptr<void>(std::move(lease))};
    }

    bool owns(const void* p, size_t bytes) const override {
        return pool_->find(p, bytes).has_value();
    }

    PoolStats pool_stats() const override { return pool_->stats(); }

    TransferStats transfer_stats() const override {
        std::lock_guard<std::mutex> lock(transfers_mu_);
        return transfers_;
    }

    std::string device_name() const override { return device_->name(); }
    GpuInfo gpu() const override { return device_->gpu(); }

    void clear_cache() override {
        with_autorelease_pool([&] { pool_->clear_cache(); });
    }
    size_t set_cache_limit(size_t bytes) override { return pool_->set_cache_limit(bytes); }

    // Staging, planning, scratch and copy-back are staging.h's run_staged_*
    // (tests run them under metal-sim); the device encodes the plan and waits.
    void forward(const FlashParams& p, const ForwardIO& io) override {
        if (selftest_) selftest_->check_forward(*this, p, io.dtype);
        with_autorelease_pool([&] {
            record(run_staged_forward(*pool_, p, io, device_->gpu(),
                                      [&](const Plan& plan, const Call& call) {
                device_->execute(plan, call);
            }));
        });
    }

    void backward(const FlashParams& p, const BackwardIO& io) override {
        if (selftest_) selftest_->check_backward(*this, p, io.dtype);
        with_autorelease_pool([&] {
            record(run_staged_backward(*pool_, p, io, [&](const Plan& plan, const Call& call) {
                device_->execute(plan, call);
            }));
        });
    }

    // A variable-length batch in one plan (staging.h's run_staged_*_varlen):
    // one command buffer whatever the number of sequences. The self-test
    // checks the varlen pipelines with a varlen probe call of its own.
    void forward_varlen(const Varlen& call, const ForwardIO& io) override {
        if (selftest_) selftest_->check_forward_varlen(*this, call, io.dtype);
        with_autorelease_pool([&] {
            record(run_staged_forward_varlen(*pool_, call, io, device_->gpu(),
                                             [&](const Plan& plan, const Call& c) {
                device_->execute(plan, c);
            }));
        });
    }

    void backward_varlen(const Varlen& call, const BackwardIO& io) override {
        if (selftest_) selftest_->check_backward_varlen(*this, call, io.dtype);
        with_autorelease_pool([&] {
            record(run_staged_backward_varlen(*pool_, call, io, [&](const Plan& plan, const Call& c) {
                device_->execute(plan, c);
            }));
        });
    }

private:
    static size_t page_size() {
        const long page = sysconf(_SC_PAGESIZE);
        return page > 0 ? size_t(page) : 16384;
    }

    // A quarter of the memory Metal recommends for this device's working set.
    static size_t default_cache_limit(id<MTLDevice> device) {
        return size_t(device.recommendedMaxWorkingSetSize / 4);
    }

    void record(const TransferStats& t) {
        std::lock_guard<std::mutex> lock(transfers_mu_);
        transfers_.add(t);
    }

    std::unique_ptr<Device> device_;
    std::shared_ptr<Pool> pool_;
    std::unique_ptr<SelfTest> selftest_;  // null with FLASHATTN_METAL_SELFTEST=0
    std::once_flag reference_once_;
    std::unique_ptr<Engine> reference_;
    mutable std::mutex transfers_mu_;
    TransferStats transfers_;
};

}  // namespace
}  // namespace metal

std::unique_ptr<Engine> make_metal_engine() {
    std::unique_ptr<Engine> engine;
    metal::with_autorelease_pool([&] {
        std::unique_ptr<metal::Device> device = metal::Device::create_default();
        if (device) engine = std::make_unique<metal::MetalEngineImpl>(std::move(device));
    });
    return engine;
}

}  // namespace flashattn
