// How metal-sim runs a launch. Threadgroups run one after another; within
// one, every GPU thread is a CPU thread of its own, in one of two modes:
//  - threads: one std::thread per GPU thread, alive for the whole launch,
//    meeting at a rendezvous between groups. A missing barrier is a real
//    data race, which ThreadSanitizer reports. Used by sanitizer builds and
//    off Linux, or when FLASHATTN_SIM_THREADS=1.
//  - fibers (Linux default): one fiber (sim/fiber.h) per GPU thread, all on the
//    calling thread, switched at barriers and SIMD-group calls. Same
//    rendezvous code and checks, a fraction of the cost (no kernel wake-ups),
//    and a wait that cannot finish is reported instead of hanging.
// Barriers and SIMD-group functions are rendezvous among the group's (or the
// SIMD group's) threads, so threadgroup memory is shared within a group. One
// launch at a time in the process: threadgroup arrays are function-scope
// statics.
#include "sim/launcher.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>

#include "core/chunks.h"
#include "core/interrupt.h"
#include "sim/runtime.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FA_SIM_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FA_SIM_SANITIZED 1
#endif
#endif
// Sanitizers do not follow stack switches; macOS deprecates ucontext.
#if defined(__linux__) && !defined(FA_SIM_SANITIZED)
#define FA_SIM_FIBERS 1
#include "sim/fiber.h"
#endif

namespace flashattn::sim {
namespace {

// Thrown inside a kernel's threads when their threadgroup has failed (a
// divergent barrier); unwinds the kernel back to the worker loop.
struct Abort {};

class LaunchState;

// Arrivals and exits at any rendezvous: in fiber mode, a whole pass over the
// fibers without one means they wait for each other forever.
std::atomic<uint64_t> g_progress{0};

// Blocks until `a` no longer holds `old` (futex wait, or in fiber mode by
// switching to the other fibers). Defined after LaunchState.
void wait_change(std::atomic<uint32_t>& a, uint32_t old);

// A rendezvous of `count` threads. Each arrival carries a tag (which
// barrier, in program order); all arrivals of one phase must carry the same
// tag. A thread that has returned from the kernel leaves for good (exit());
// a phase completed while some threads had left means the others met a
// barrier the leavers never reached: divergence, as on a GPU an error.
class Rendezvous {
public:
    // `failed` is set when a phase diverges.
    void reset(unsigned count, bool* failed = nullptr) {
        failed_ = failed;
        count_ = count;
        arrived_ = 0;
        exited_ = 0;
        diverged_ = false;
    }

    // Returns false when the phase diverged. `complete` runs once per phase,
    // in the last thread to arrive, before anyone is released.
    template <class F>
    bool arrive(uint64_t tag, F&& complete) {
        std::unique_lock<std::mutex> lock(mutex_);
        const uint32_t gen = generation_.load(std::memory_order_relaxed);
        if (arrived_ == 0) tag_ = tag;
        else if (tag != tag_) diverged_ = true;
        ++arrived_;
        g_progress.fetch_add(1, std::memory_order_relaxed);
        if (arrived_ + exited_ == count_) {
            finish(complete);
            return phase_ok_;
        }
        lock.unlock();
        wait_change(generation_, gen);
        return phase_ok_;
    }
    bool arrive(uint64_t tag) {
        return arrive(tag, [](bool) {});
    }

    // This thread will not arrive again in this threadgroup.
    void exit() {
        std::lock_guard<std::mutex> lock(mutex_);
        ++exited_;
        g_progress.fetch_add(1, std::memory_order_relaxed);
        if (arrived_ > 0 && arrived_ + exited_ == count_) finish([](bool) {});
    }

private:
    template <class F>
    void finish(F&& complete) {  // mutex_ held
        const bool ok = !diverged_ && exited_ == 0;
        if (!ok && failed_) *failed_ = true;
        complete(ok);
        phase_ok_ = ok;
        arrived_ = 0;
        diverged_ = false;
        generation_.fetch_add(1, std::memory_order_release);
        generation_.notify_all();
    }

    std::mutex mutex_;
    std::atomic<uint32_t> generation_{0};
    unsigned count_ = 0, arrived_ = 0, exited_ = 0;
    uint64_t tag_ = 0;
    bool diverged_ = false;
    bool phase_ok_ = true;  // written before generation_ moves, read after
    bool* failed_ = nullptr;
};

// Slots through which the lanes of one SIMD group exchange values: two
// sets, used by alternate exchanges, so one rendezvous per exchange is
// enough (a lane can only write set s again two exchanges later, after
// every lane has arrived at the exchange in between, so after every lane
// has read set s).
struct SimdGroup {
    Rendezvous sync;
    unsigned lanes = 0;
    alignas(16) unsigned char slots[2][fa_sim::kSimdWidth][fa_sim::kMaxExchangeBytes];
    alignas(16) unsigned char results[2][fa_sim::kSimdWidth][fa_sim::kMaxExchangeBytes];
};

constexpr size_t kMaxThreadgroupBytes = 32 * 1024;  // Apple GPUs
constexpr unsigned kMaxThreadsPerGroup = 1024;

class LaunchState {
public:
    LaunchState(const Kernel& kernel, const std::vector<Binding>& buffers, Dim3 grid, Dim3 group)
        : kernel_(kernel), buffers_(buffers), grid_(grid),
          threads_(group.x * group.y * group.z),
          groups_(uint64_t(grid.x) * grid.y * grid.z),
          simd_((threads_ + fa_sim::kSimdWidth - 1) / fa_sim::kSimdWidth) {
        between_.reset(threads_);
        for (unsigned s = 0; s < simd_.size(); ++s)
            simd_[s].lanes = std::min(fa_sim::kSimdWidth, threads_ - s * fa_sim::kSimdWidth);
        reset_group();
    }

    void run() {
#ifdef FA_SIM_FIBERS
        if (fibers_enabled()) {
            run_fibers();
        } else {
            run_threads();
        }
#else
        run_threads();
#endif
        if (!error_.empty()) throw std::runtime_error("metal-sim: " + kernel_.name + ": " + error_);
        if (interrupted_.load()) throw Interrupted();
    }

    static bool fibers_enabled() {
#ifdef FA_SIM_FIBERS
        const char* env = std::getenv("FLASHATTN_SIM_THREADS");
        return !(env && std::strcmp(env, "1") == 0);
#else
        return false;
#endif
    }

    void run_threads() {
        std::vector<std::thread> workers;
        workers.reserve(threads_);
        try {
            for (unsigned t = 0; t < threads_; ++t) workers.emplace_back([this, t] { work(t); });
        } catch (...) {
            // The started threads must not wait for the missing ones.
            fail("could not start " + std::to_string(threads_) + " threads");
            stop_ = true;  // before any thread passes started_
        }
        started_.store(1, std::memory_order_release);
        started_.notify_all();
        // The workers run the groups; this thread polls for an interrupt,
        // which the next end_group() turns into a stop.
        for (;;) {
            {
                std::unique_lock<std::mutex> lock(exit_mutex_);
                if (all_exited_.wait_for(lock, std::chrono::milliseconds(10),
                                         [&] { return exited_ == workers.size(); }))
                    break;
            }
            // Without the lock: the poll runs Python's signal handlers.
            if (interrupt_requested()) interrupted_.store(true);
        }
        for (auto& w : workers) w.join();
    }

    // Runtime entry points, called from the kernel's threads.
    void barrier(uint64_t& count) {
        if (!barrier_.arrive(count++)) throw Abort{};
    }
    void simd_exchange(unsigned tid, uint64_t& count, const void* value, size_t bytes, void* out,
                       unsigned* lanes) {
        SimdGroup& g = simd_[tid / fa_sim::kSimdWidth];
        auto& set = g.slots[count % 2];
        std::memcpy(set[tid % fa_sim::kSimdWidth], value, bytes);
        if (!g.sync.arrive(count++)) throw Abort{};
        for (unsigned l = 0; l < g.lanes; ++l)
            std::memcpy(static_cast<unsigned char*>(out) + l * bytes, set[l], bytes);
        *lanes = g.lanes;
    }
    void simd_collective(unsigned tid, uint64_t& count, const void* offer, size_t bytes,
                         fa_sim::SimdCombine combine, void* out, size_t result_bytes) {
        SimdGroup& g = simd_[tid / fa_sim::kSimdWidth];
        const unsigned parity = unsigned(count % 2);
        std::memcpy(g.slots[parity][tid % fa_sim::kSimdWidth], offer, bytes);
        // The slots of one lane are kMaxExchangeBytes apart; combine wants
        // the offers packed, `bytes` apart.
        const bool ok = g.sync.arrive(count++, [&](bool) {
            unsigned char packed[fa_sim::kSimdWidth * fa_sim::kMaxExchangeBytes];
            unsigned char results[fa_sim::kSimdWidth * fa_sim::kMaxExchangeBytes];
            for (unsigned l = 0; l < g.lanes; ++l)
                std::memcpy(packed + l * bytes, g.slots[parity][l], bytes);
            combine(packed, g.lanes, results);
            for (unsigned l = 0; l < g.lanes; ++l)
                std::memcpy(g.results[parity][l], results + l * result_bytes, result_bytes);
        });
        if (!ok) throw Abort{};
        std::memcpy(out, g.results[parity][tid % fa_sim::kSimdWidth], result_bytes);
    }
    void note_array(void* data, size_t bytes) {
        std::lock_guard<std::mutex> lock(arrays_mutex_);
        for (const auto& a : arrays_)
            if (a.first == data) return;
        // First use in this launch: no thread of the group has written it
        // yet (each registers before touching it), so start it as garbage.
        std::memset(data, 0xff, bytes);
        arrays_.emplace_back(data, bytes);
        size_t total = 0;
        for (const auto& a : arrays_) total += a.second;
        if (total > kMaxThreadgroupBytes)
            fail("uses " + std::to_string(total) +
                               " bytes of threadgroup memory, more than Apple's " +
                               std::to_string(kMaxThreadgroupBytes));
    }

    // What a kernel thread's runtime calls need to find their launch.
    struct Ctx {
        LaunchState* launch;
        unsigned tid;
        uint64_t barriers = 0;
        uint64_t simd_ops = 0;
#ifdef FA_SIM_FIBERS
        FiberContext* self = nullptr;  // set in fiber mode
        FiberContext* scheduler = nullptr;
        bool finished = false;
#endif
    };

#ifdef FA_SIM_FIBERS
    // A waiting fiber hands control back to the scheduler; it resumes in
    // the next pass, or unwinds when the group is being abandoned.
    void yield(Ctx& c);
#endif

private:
    void work(unsigned tid);
    // One GPU thread's part of group g: the kernel, then leaving the group.
    void run_in_group(Ctx& ctx, const Builtins& bi, uint64_t g) {
        ctx.barriers = 0;
        ctx.simd_ops = 0;
        try {
            kernel_.run(buffers_, bi);
        } catch (const Abort&) {
        } catch (const std::exception& e) {
            fail(group_name(g) + ": " + e.what());
        }
        barrier_.exit();
        simd_[ctx.tid / fa_sim::kSimdWidth].sync.exit();
    }
#ifdef FA_SIM_FIBERS
    void run_fibers();
    static void fiber_entry(void* arg);
    bool aborting_ = false;
    uint64_t fiber_group_ = 0;
    Builtins* fiber_builtins_ = nullptr;
#endif

    void fail(const std::string& why) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (error_.empty()) error_ = why;
        failed_.store(true);
    }

    std::string group_name(uint64_t g) const {
        return "threadgroup (" + std::to_string(g % grid_.x) + ", " +
               std::to_string(g / grid_.x % grid_.y) + ", " +
               std::to_string(g / (uint64_t(grid_.x) * grid_.y)) + ")";
    }

    // Between two threadgroups, in one thread: the group's threadgroup
    // memory becomes garbage (NaN bytes) and the rendezvous start afresh.
    void end_group(uint64_t g) {
        if (barrier_phase_failed_ || simd_phase_failed_)
            fail(group_name(g) + ": its threads did not all reach the same " +
                 (barrier_phase_failed_ ? "threadgroup_barrier" : "SIMD-group function") +
                 " (a barrier or SIMD-group call skipped by some threads, or reached after others returned)");
        if (failed_.load() || interrupted_.load() || all_calls_stopped()) stop_ = true;
        if (all_calls_stopped()) interrupted_.store(true);
        std::lock_guard<std::mutex> lock(arrays_mutex_);
        for (const auto& a : arrays_) std::memset(a.first, 0xff, a.second);
        reset_group();
    }

    void reset_group() {
        barrier_phase_failed_ = simd_phase_failed_ = false;
        barrier_.reset(threads_, &barrier_phase_failed_);
        for (auto& s : simd_) s.sync.reset(s.lanes, &simd_phase_failed_);
    }

    const Kernel& kernel_;
    const std::vector<Binding>& buffers_;
    Dim3 grid_;
    unsigned threads_;
    uint64_t groups_;
    Rendezvous barrier_, between_;
    std::vector<SimdGroup> simd_;
    std::atomic<int> started_{0};
    std::atomic<bool> failed_{false};
    std::atomic<bool> interrupted_{false};  // the call is to stop between groups
    std::mutex exit_mutex_;  // thread mode: workers leaving the launch
    std::condition_variable all_exited_;
    size_t exited_ = 0;
    bool stop_ = false;  // written and read only between groups
    bool barrier_phase_failed_ = false, simd_phase_failed_ = false;  // guarded by the rendezvous
    std::mutex error_mutex_, arrays_mutex_;
    std::string error_;
    std::vector<std::pair<void*, size_t>> arrays_;

public:
    static thread_local Ctx* current;
};

thread_local LaunchState::Ctx* LaunchState::current = nullptr;

void LaunchState::work(unsigned tid) {
    Ctx ctx{this, tid};
    current = &ctx;
    Builtins bi{};
    bi.thread = tid;
    bi.lane = tid % fa_sim::kSimdWidth;
    bi.simdgroup = tid / fa_sim::kSimdWidth;
    while (started_.load(std::memory_order_acquire) == 0) started_.wait(0, std::memory_order_acquire);
    for (uint64_t g = 0; g < groups_; ++g) {
        // stop_ only changes inside the between-groups rendezvous, so every
        // thread takes the same branch here (failed_ may change mid-group).
        if (stop_) break;
        bi.group[0] = uint32_t(g % grid_.x);
        bi.group[1] = uint32_t(g / grid_.x % grid_.y);
        bi.group[2] = uint32_t(g / (uint64_t(grid_.x) * grid_.y));
        run_in_group(ctx, bi, g);
        between_.arrive(0, [&](bool) { end_group(g); });
    }
    current = nullptr;
    std::lock_guard<std::mutex> lock(exit_mutex_);
    ++exited_;
    all_exited_.notify_all();
}

#ifdef FA_SIM_FIBERS
constexpr size_t kFiberStack = 256 * 1024;

// Fiber stacks, kept across launches (launches are serialised).
std::vector<std::unique_ptr<char[]>>& fiber_stacks() {
    static std::vector<std::unique_ptr<char[]>> stacks;
    return stacks;
}

void LaunchState::yield(Ctx& c) {
    fiber_switch(*c.self, *c.scheduler);
    if (aborting_) throw Abort{};
}

void LaunchState::fiber_entry(void* arg) {
    Ctx& c = *static_cast<Ctx*>(arg);
    LaunchState& L = *c.launch;
    L.run_in_group(c, L.fiber_builtins_[c.tid], L.fiber_group_);
    c.finished = true;
    fiber_switch(*c.self, *c.scheduler);  // for good: the scheduler never resumes us
}

void LaunchState::run_fibers() {
    auto& stacks = fiber_stacks();
    while (stacks.size() < threads_) stacks.emplace_back(new char[kFiberStack]);
    std::vector<FiberContext> fibers(threads_);
    std::vector<Ctx> ctxs(threads_, Ctx{this, 0});
    std::vector<Builtins> builtins(threads_);
    fiber_builtins_ = builtins.data();
    FiberContext scheduler;
    for (uint64_t g = 0; g < groups_ && !stop_; ++g) {
        if (interrupt_requested()) {
            interrupted_.store(true);
            break;
        }
        fiber_group_ = g;
        for (unsigned t = 0; t < threads_; ++t) {
            Builtins& bi = builtins[t];
            bi.group[0] = uint32_t(g % grid_.x);
            bi.group[1] = uint32_t(g / grid_.x % grid_.y);
            bi.group[2] = uint32_t(g / (uint64_t(grid_.x) * grid_.y));
            bi.thread = t;
            bi.lane = t % fa_sim::kSimdWidth;
            bi.simdgroup = t / fa_sim::kSimdWidth;
            ctxs[t] = Ctx{this, t};
            ctxs[t].self = &fibers[t];
            ctxs[t].scheduler = &scheduler;
            fiber_prepare(fibers[t], stacks[t].get(), kFiberStack, &LaunchState::fiber_entry, &ctxs[t]);
        }
        unsigned done = 0;
        while (done < threads_) {
            const uint64_t before = g_progress.load(std::memory_order_relaxed);
            for (unsigned t = 0; t < threads_; ++t) {
                if (ctxs[t].finished) continue;
                current = &ctxs[t];
                fiber_switch(scheduler, fibers[t]);
                current = nullptr;
                done += ctxs[t].finished;
            }
            if (done < threads_ && g_progress.load(std::memory_order_relaxed) == before) {
                // Everyone left is waiting and nobody can arrive: in thread
                // mode this would hang; here the waiters unwind.
                fail(group_name(g) +
                     ": its threads wait for each other forever (some at a threadgroup_barrier, "
                     "others at a SIMD-group function, or at different ones)");
                aborting_ = true;
            }
        }
        aborting_ = false;
        end_group(g);
    }
}
#endif

void wait_change(std::atomic<uint32_t>& a, uint32_t old) {
#ifdef FA_SIM_FIBERS
    if (LaunchState::Ctx* c = LaunchState::current; c && c->self) {
        while (a.load(std::memory_order_acquire) == old) c->launch->yield(*c);
        return;
    }
#endif
    while (a.load(std::memory_order_acquire) == old) a.wait(old, std::memory_order_acquire);
}

// One launch at a time (threadgroup arrays are statics). A child forked
// while another thread held it would wait forever: it gets a fresh one
// (that thread, and its launch, do not exist in the child).
std::mutex g_launch_mutex;
void renew_launch_mutex_in_child() { new (&g_launch_mutex) std::mutex(); }

std::mutex& launch_mutex() {
    static const int registered = pthread_atfork(nullptr, nullptr, renew_launch_mutex_in_child);
    (void)registered;
    return g_launch_mutex;
}

// Set while this thread runs a launch. Its interrupt polls run Python's
// signal handlers, and one that calls metal-sim again would wait for the
// launch lock this thread holds, forever: such a call is refused instead.
thread_local bool t_launching = false;

struct Launching {
    Launching() { t_launching = true; }
    ~Launching() { t_launching = false; }
};

// The kernels' program-scope function constants (registered at static
// initialisation, before any launch).
struct ConstantSlot {
    unsigned index;
    size_t bytes;
    bool is_float;
    void* value;
    bool* defined;
};
std::vector<ConstantSlot>& constant_slots() {
    static std::vector<ConstantSlot> slots;
    return slots;
}

// Under the launch mutex: every registered constant takes the launch's
// value for its index, or becomes undefined.
void set_function_constants(const std::string& kernel, const std::vector<FunctionConstant>& values) {
    for (const FunctionConstant& c : values) {
        bool known = false;
        for (const ConstantSlot& slot : constant_slots())
            known = known || slot.index == c.index;
        if (!known)
            throw std::runtime_error("metal-sim: " + kernel + ": function constant " +
                                     std::to_string(c.index) + " is declared by no kernel");
    }
    for (const ConstantSlot& slot : constant_slots()) {
        *slot.defined = false;
        for (const FunctionConstant& c : values) {
            if (c.index != slot.index) continue;
            const bool is_float = c.type == FunctionConstant::Type::float32;
            const bool is_bool = c.type == FunctionConstant::Type::boolean;
            if (is_float != slot.is_float || (is_bool != (slot.bytes == 1)))
                throw std::runtime_error("metal-sim: " + kernel + ": function constant " +
                                         std::to_string(c.index) + " is given a value of another type");
            if (is_bool) {
                const bool b = c.bits != 0;
                std::memcpy(slot.value, &b, 1);
            } else {
                std::memcpy(slot.value, &c.bits, 4);
            }
            *slot.defined = true;
        }
    }
}

}  // namespace

namespace {
void tally_kernel(const std::string& name, const OpCounts& before);
}  // namespace

void run_launch(const Kernel& kernel, const std::vector<Binding>& buffers, Dim3 grid, Dim3 group,
                const std::vector<FunctionConstant>& constants) {
    const uint64_t threads = uint64_t(group.x) * group.y * group.z;
    // [[max_total_threads_per_threadgroup(N)]] (FA_MAX_THREADS): Metal refuses
    // a dispatch above the pipeline's limit, which is N for such a kernel.
    if (const uint32_t declared = declared_max_threads(kernel.name); declared && threads > declared)
        throw std::runtime_error("metal-sim: " + kernel.name + ": " + std::to_string(threads) +
                                 " threads per threadgroup, above the " + std::to_string(declared) +
                                 " its max_total_threads_per_threadgroup declares");
    const std::string why = kernel.check(buffers);
    if (!why.empty()) throw std::runtime_error("metal-sim: " + kernel.name + ": " + why);
    if (threads == 0 || threads > kMaxThreadsPerGroup)
        throw std::runtime_error("metal-sim: " + kernel.name + ": " + std::to_string(threads) +
                                 " threads per threadgroup (must be 1.." +
                                 std::to_string(kMaxThreadsPerGroup) + ")");
    if (uint64_t(grid.x) * grid.y * grid.z == 0) return;
    throw_if_interrupted();  // between the launches of a plan
    if (t_launching)
        throw std::runtime_error(
            "metal-sim: " + kernel.name + ": called while this thread's own metal-sim launch is "
            "running (from a signal handler?); metal-sim runs one launch at a time: make the "
            "call after that one returns");
    std::lock_guard<std::mutex> lock(launch_mutex());
    const Launching launching;
    set_function_constants(kernel.name, constants);
    LaunchState state(kernel, buffers, grid, group);
    const OpCounts before = op_counts();
    state.run();
    tally_kernel(kernel.name, before);  // one launch at a time: the difference is this launch's
}

const char* execution_mode() { return LaunchState::fibers_enabled() ? "fibers" : "threads"; }

void* unused_slot_buffer() {
    alignas(16) static float poison[4] = {std::numeric_limits<float>::quiet_NaN(),
                                          std::numeric_limits<float>::quiet_NaN(),
                                          std::numeric_limits<float>::quiet_NaN(),
                                          std::numeric_limits<float>::quiet_NaN()};
    return poison;
}

void run_plan(const Plan& plan, const SlotPointers& call_slots) {
    // The plan's scratch lives for the call, as the metal host's pool leases do.
    SlotPointers slots = call_slots;
    std::vector<std::vector<float>> scratch;
    for (const Scratch& s : plan.scratch) {
        scratch.emplace_back(size_t(s.floats));
        slots[size_t(s.slot)] = scratch.back().empty() ? nullptr : scratch.back().data();
    }
    // The pieces the metal host would encode (core/chunks.h), each with its
    // origin in a params copy: FLASHATTN_MAX_GROUPS_PER_PIECE forces tiny
    // pieces, so tests check that cut-up grids give the same bits.
    const Schedule schedule = schedule_plan(plan, work_model_from_env());
    for (const Piece& piece : schedule.pieces) {
        const Launch& launch = plan.launches[piece.launch];
        const Kernel* kernel = find_kernel(launch.kernel);
        if (!kernel) throw std::runtime_error("metal-sim: no kernel named '" + launch.kernel + "'");
        FlashParams params = params_for_piece(plan.params, piece);
        std::vector<Binding> buffers;
        for (Slot s : launch.buffers) {
            if (s == Slot::params)
                buffers.push_back({&params, true});
            else if (s == Slot::score)
                buffers.push_back({const_cast<FlashScoreParams*>(&plan.score), true});
            else
                buffers.push_back({slots[size_t(s)], false});
        }
        run_launch(*kernel, buffers, piece.grid, launch.threadgroup, launch.constants);
    }
}

namespace {
std::atomic<uint64_t> g_counts[5];
std::mutex g_by_kernel_mutex;
std::map<std::string, OpCounts> g_by_kernel;

void tally_kernel(const std::string& name, const OpCounts& before) {
    const OpCounts now = op_counts();
    std::lock_guard<std::mutex> lock(g_by_kernel_mutex);
    OpCounts& k = g_by_kernel[name];
    k.mma += now.mma - before.mma;
    k.matrix_loads += now.matrix_loads - before.matrix_loads;
    k.matrix_stores += now.matrix_stores - before.matrix_stores;
    k.simd_exchanges += now.simd_exchanges - before.simd_exchanges;
    k.barriers += now.barriers - before.barriers;
}
}  // namespace

OpCounts op_counts() {
    OpCounts c;
    c.mma = g_counts[size_t(fa_sim::Op::mma)].load();
    c.matrix_loads = g_counts[size_t(fa_sim::Op::matrix_load)].load();
    c.matrix_stores = g_counts[size_t(fa_sim::Op::matrix_store)].load();
    c.simd_exchanges = g_counts[size_t(fa_sim::Op::simd_exchange)].load();
    c.barriers = g_counts[size_t(fa_sim::Op::barrier)].load();
    return c;
}

void reset_op_counts() {
    for (auto& c : g_counts) c.store(0);
    std::lock_guard<std::mutex> lock(g_by_kernel_mutex);
    g_by_kernel.clear();
}

std::map<std::string, OpCounts> op_counts_by_kernel() {
    std::lock_guard<std::mutex> lock(g_by_kernel_mutex);
    return g_by_kernel;
}

void count(fa_sim::Op op) { g_counts[size_t(op)].fetch_add(1, std::memory_order_relaxed); }

}  // namespace flashattn::sim

// The runtime the shim's kernels call (runtime.h).
namespace fa_sim {

using flashattn::sim::LaunchState;

static LaunchState::Ctx& ctx() {
    LaunchState::Ctx* c = LaunchState::current;
    if (!c) throw std::logic_error("metal-sim: kernel code called outside a launch");
    return *c;
}

void threadgroup_barrier() {
    auto& c = ctx();
    if (c.tid == 0) flashattn::sim::count(Op::barrier);
    c.launch->barrier(c.barriers);
}

void count_op(Op op) {
    if (ctx().tid % kSimdWidth == 0) flashattn::sim::count(op);
}

void simd_exchange(const void* value, std::size_t bytes, void* lanes_out, unsigned* active_lanes) {
    auto& c = ctx();
    if (c.tid % kSimdWidth == 0) flashattn::sim::count(Op::simd_exchange);
    c.launch->simd_exchange(c.tid, c.simd_ops, value, bytes, lanes_out, active_lanes);
}

void simd_collective(const void* offer, std::size_t bytes, SimdCombine combine, void* result_out,
                     std::size_t result_bytes) {
    auto& c = ctx();
    c.launch->simd_collective(c.tid, c.simd_ops, offer, bytes, combine, result_out, result_bytes);
}

unsigned simd_lane() { return ctx().tid % kSimdWidth; }

namespace {
std::atomic<int> g_lane_fault{-1};  // -1: not read from the environment yet
}  // namespace

bool lane_map_fault() {
    int v = g_lane_fault.load(std::memory_order_relaxed);
    if (v < 0) {
        const char* env = std::getenv("FLASHATTN_SIM_LANE_FAULT");
        int expected = -1;
        g_lane_fault.compare_exchange_strong(expected, env && std::strcmp(env, "1") == 0 ? 1 : 0);
        v = g_lane_fault.load(std::memory_order_relaxed);
    }
    return v == 1;
}

void set_lane_map_fault(bool on) { g_lane_fault.store(on ? 1 : 0); }

void note_threadgroup_array(void* data, std::size_t bytes) { ctx().launch->note_array(data, bytes); }

void register_function_constant(unsigned index, std::size_t bytes, bool is_float, void* value,
                                bool* defined) {
    if (bytes != 1 && bytes != 4)
        throw std::logic_error("metal-sim: function constants are bool, int or float");
    flashattn::sim::constant_slots().push_back({index, bytes, is_float, value, defined});
}

}  // namespace fa_sim
