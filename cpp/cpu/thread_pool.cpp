// The persistent worker pool behind flashattn::cpu::parallel_for. Jobs sit in
// a queue; workers and the submitting thread claim task indices with an atomic
// counter, so a call always finishes even with no worker free (or none at all).
#include "cpu/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/interrupt.h"

namespace flashattn::cpu {
namespace {

struct Job;

// FLASHATTN_CPU_PROFILE=1: every call's task times are recorded (thread_pool.h).
bool profiling() {
    static const bool on = [] {
        const char* env = std::getenv("FLASHATTN_CPU_PROFILE");
        return env && env[0] == '1' && env[1] == '\0';
    }();
    return on;
}

std::mutex g_profile_m;
std::vector<PoolCallProfile> g_profile;

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// The task this thread is running, for stop_if_interrupted: its job, and
// whether this thread submitted it (then it polls for the interrupt).
struct CurrentTask {
    Job* job = nullptr;
    bool by_caller = false;
};
thread_local CurrentTask t_current;

struct Job {
    const std::function<void(int64_t)>* task = nullptr;
    int64_t n = 0;
    // Claims and completions on lines of their own: the threads that start
    // tasks do not slow the ones that finish theirs.
    alignas(64) std::atomic<int64_t> next{0};
    alignas(64) std::atomic<int64_t> done{0};
    bool exhausted() const { return next.load(std::memory_order_relaxed) >= n; }
    // Set when the call is interrupted: the tasks not yet started are skipped.
    std::atomic<bool> cancelled{false};
    bool profile = false;  // time each task (profiling())
    std::atomic<int64_t> busy_ns{0}, longest_ns{0};
    std::mutex m;  // guards error and the wake-up of the submitter
    std::condition_variable finished;
    std::exception_ptr error;

    bool stopping() const { return cancelled.load(std::memory_order_relaxed) || all_calls_stopped(); }

    // True when the call should stop; the submitting thread (by_caller)
    // polls for an interrupt first. Called with no lock held: the poll runs
    // Python's signal handlers, which may call in again (set_num_threads
    // joins the workers, which then need this job's lock to finish).
    bool check(bool by_caller) {
        if (by_caller && interrupt_requested()) cancelled.store(true);
        return stopping();
    }

    // Claims and runs tasks until none is left to claim, checking before
    // each; a task checks between its blocks of work too (stop_if_interrupted).
    // True for the one thread whose claim first found the job exhausted (it
    // takes the job off the queue).
    bool work(bool by_caller) {
        const CurrentTask outer = t_current;
        int64_t i;
        for (; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
            if (!check(by_caller)) {
                t_current = {this, by_caller};
                const int64_t t0 = profile ? now_ns() : 0;
                try {
                    (*task)(i);
                } catch (const Interrupted&) {
                    cancelled.store(true);
                } catch (...) {
                    std::lock_guard<std::mutex> lk(m);
                    if (!error) error = std::current_exception();
                }
                t_current = outer;
                if (profile) {
                    const int64_t t = now_ns() - t0;
                    busy_ns.fetch_add(t, std::memory_order_relaxed);
                    int64_t seen = longest_ns.load(std::memory_order_relaxed);
                    while (t > seen && !longest_ns.compare_exchange_weak(seen, t)) {
                    }
                }
            }
            if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
                std::lock_guard<std::mutex> lk(m);
                finished.notify_all();
            }
        }
        return i == n;
    }
};

// The most workers a pool ever had (their hazard slots, Pool::watch).
constexpr int kMaxWorkers = kMaxThreads - 1;

// How long an idle worker watches for new work before it sleeps.
constexpr auto kSpin = std::chrono::microseconds(100);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// While the submitter waits for the workers' last tasks, it still polls.
constexpr auto kWaitSlice = std::chrono::milliseconds(10);

int threads_from_environment() {
    const char* env = std::getenv("FLASHATTN_NUM_THREADS");
    if (env && *env) {
        char* end = nullptr;
        const long n = std::strtol(env, &end, 10);
        if (*end != '\0' || n < 1 || n > kMaxThreads)
            throw std::invalid_argument(std::string("FLASHATTN_NUM_THREADS must be an integer in 1..") +
                                        std::to_string(kMaxThreads) + ", got '" + env + "'");
        return int(n);
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : int(hw);
}

class Pool {
public:
    explicit Pool(int threads) { start(threads); }
    ~Pool() { stop(); }

    int threads() const { return threads_.load(); }

    // Waits for the running jobs' tasks (the workers finish what they hold);
    // when the system cannot start `threads`, goes back to the old count and
    // throws std::runtime_error.
    void resize(int threads) {
        std::lock_guard<std::mutex> lk(resize_m_);
        const int old = threads_.load();
        if (threads == old) return;
        stop();
        try {
            start(threads);
        } catch (const std::runtime_error& e) {
            int kept = old;
            try {
                start(old);
            } catch (const std::runtime_error&) {
                start(kept = 1);  // no worker to start: cannot fail
            }
            throw std::runtime_error(std::string("set_num_threads: ") + e.what() + "; keeping " +
                                     std::to_string(kept) + " thread" + (kept == 1 ? "" : "s"));
        }
    }

    void run(int64_t n, const std::function<void(int64_t)>& task) {
        if (n <= 0) return;
        const auto job = std::make_shared<Job>();
        job->task = &task;
        job->n = n;
        job->profile = profiling();
        const int64_t start = job->profile ? now_ns() : 0;
        const bool queued = n > 1 && threads_.load() > 1;
        if (queued) {
            std::lock_guard<std::mutex> lk(m_);
            queue_.push_back(job);
            if (queue_.size() == 1) publish_front();
            wake_.notify_all();
        }
        // The thread whose claim first finds the job exhausted takes it off
        // the queue: until then idle workers keep coming back to it at the
        // front, and a poll below that resizes the pool (a signal
        // handler calling set_num_threads) would wait forever to join them.
        if (job->work(true) && queued) retire(job.get());
        // The workers' last tasks are usually short: watch for them a moment
        // before sleeping on the condition variable (a wake-up costs more).
        const auto until = std::chrono::steady_clock::now() + kSpin;
        while (job->done.load(std::memory_order_acquire) != n &&
               std::chrono::steady_clock::now() < until)
            cpu_relax();
        for (;;) {
            {
                std::unique_lock<std::mutex> lk(job->m);
                if (job->finished.wait_for(lk, kWaitSlice, [&] { return job->done.load() == n; }))
                    break;
            }
            job->check(true);  // without the lock: the poll may call in again
        }
        if (queued) retire(job.get());
        // A worker watching the queue may still hold the job's address (its
        // hazard slot): the job lives until none does. (A job never queued
        // was never in a slot, nor on the queue: a one-task call takes no
        // lock and reads no slot.)
        const int slots = queued ? hazard_slots_.load(std::memory_order_acquire) : 0;
        for (int w = 0; w < slots; ++w)
            while (hazards_[w].job.load(std::memory_order_seq_cst) == job.get()) cpu_relax();
        if (job->profile) {
            const double wall = 1e-9 * double(now_ns() - start);
            std::lock_guard<std::mutex> lk(g_profile_m);
            g_profile.push_back({n, threads_.load(), wall, 1e-9 * double(job->busy_ns.load()),
                                 1e-9 * double(job->longest_ns.load())});
        }
        if (job->stopping()) throw Interrupted();
        if (job->error) std::rethrow_exception(job->error);
    }

private:
    // Starts threads - 1 workers, or none and throws std::runtime_error.
    void start(int threads) {
        {
            std::lock_guard<std::mutex> lk(m_);
            stopping_ = false;
        }
        try {
            for (int t = 1; t < threads; ++t) {
                const int w = t - 1;
                if (hazard_slots_.load() < t) hazard_slots_.store(t, std::memory_order_release);
                workers_.emplace_back([this, w] { loop(hazards_[w]); });
            }
        } catch (const std::exception& e) {
            const size_t started = workers_.size();
            stop();
            throw std::runtime_error("the system could not start " + std::to_string(threads) +
                                     " threads (it stopped after " + std::to_string(started + 1) +
                                     "): " + e.what());
        }
        threads_.store(threads);
    }

    void stop() {
        {
            std::lock_guard<std::mutex> lk(m_);
            stopping_ = true;
            wake_.notify_all();
        }
        for (auto& w : workers_) w.join();
        workers_.clear();
        threads_.store(1);  // the callers alone, until start()
    }

    // Takes the job off the queue (if it is still there): by its submitter
    // once done, and by the thread that found it exhausted, so that idle
    // workers stop taking it and sleep again.
    void retire(const Job* job) {
        std::unique_lock<std::mutex> lk(m_, std::defer_lock);
        lock_spinning(lk);
        for (auto it = queue_.begin(); it != queue_.end(); ++it)
            if (it->get() == job) {
                const bool front = it == queue_.begin();
                queue_.erase(it);
                if (front) publish_front();
                break;
            }
    }

    // A worker's slot: the job it reads through front_ while watching the
    // queue (a hazard pointer: its submitter waits until no slot holds it).
    struct alignas(64) Hazard {
        std::atomic<Job*> job{nullptr};
    };

    void loop(Hazard& hazard) {
        for (;;) {
            if (Job* job = watch(hazard)) {
                if (job->work(false)) retire(job);
                hazard.job.store(nullptr, std::memory_order_release);
                continue;
            }
            const std::shared_ptr<Job> job = sleep_for_job();
            if (!job) return;  // stopping
            if (job->work(false)) retire(job.get());
        }
    }

    // A worker that ran out of work watches the queue for a moment before it
    // sleeps: calls come in bursts (a training step is a forward, then a
    // backward, per layer), and a sleeping worker takes a futex wake-up and a
    // reschedule, tens of microseconds on a shared machine (more where a
    // virtual CPU halts), to join the next one; a small call lasts not much
    // longer. Watching takes no lock and no reference count: the front job's
    // address is read from front_ and held in the worker's hazard slot, so a
    // call's workers start within a microsecond or two of it. (Taking m_ one
    // after another put most of them to sleep on it: 16 threads, 18.5 us
    // beyond a 20 us task, issue 36; a spinlock around a shared_ptr copy
    // still queued them one by one.) The job, or null after kSpin.
    Job* watch(Hazard& hazard) {
        const auto until = std::chrono::steady_clock::now() + kSpin;
        for (;;) {
            if (Job* job = front_.load(std::memory_order_acquire)) {
                hazard.job.store(job, std::memory_order_seq_cst);
                // Still the front after the slot was set: its submitter, which
                // takes it off the queue before it reads the slots, waits, so
                // the job may be read from here on. (A front whose tasks are
                // all claimed is left to the threads running them.)
                if (front_.load(std::memory_order_seq_cst) == job && !job->exhausted()) return job;
                hazard.job.store(nullptr, std::memory_order_release);
            }
            if (std::chrono::steady_clock::now() >= until) return nullptr;
            cpu_relax();
        }
    }

    // The queue's front job, sleeping on wake_ until there is one; null once
    // the pool stops.
    std::shared_ptr<Job> sleep_for_job() {
        std::unique_lock<std::mutex> lk(m_);
        wake_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return nullptr;
        return queue_.front();
    }

    // m_, taken without ever sleeping on it (its holders keep it for a few
    // pointer operations).
    static void lock_spinning(std::unique_lock<std::mutex>& lk) {
        while (!lk.try_lock()) cpu_relax();
    }

    // front_ = the queue's front job (or null); m_ is held.
    void publish_front() {
        front_.store(queue_.empty() ? nullptr : queue_.front().get(), std::memory_order_seq_cst);
    }

    std::mutex resize_m_;
    std::mutex m_;
    std::condition_variable wake_;
    std::deque<std::shared_ptr<Job>> queue_;
    std::atomic<Job*> front_{nullptr};  // queue_.front(), for the watching workers
    // One per worker ever started (workers are joined before a resize
    // reuses a slot); callers read the first hazard_slots_.
    std::unique_ptr<Hazard[]> hazards_{new Hazard[kMaxWorkers]};
    std::atomic<int> hazard_slots_{0};
    std::vector<std::thread> workers_;
    bool stopping_ = false;
    std::atomic<int> threads_{1};
};

std::atomic<Pool*> g_pool{nullptr};
std::mutex g_create_m;
std::atomic<int> g_requested{0};  // the last set_num_threads, kept across fork

// A forked child has none of the parent's workers and may have inherited a
// locked mutex: it leaks the old pool and builds a fresh one on first use.
void forget_pool_in_child() {
    g_pool.store(nullptr);
    new (&g_create_m) std::mutex();
}

Pool& pool() {
    if (Pool* p = g_pool.load(std::memory_order_acquire)) return *p;
    std::lock_guard<std::mutex> lk(g_create_m);
    if (Pool* p = g_pool.load(std::memory_order_acquire)) return *p;
    static std::once_flag atfork_once;
    std::call_once(atfork_once, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
    // Never destroyed: workers must outlive every static that may still call in.
    const int requested = g_requested.load();
    const int threads = requested > 0 ? requested : threads_from_environment();
    Pool* p = nullptr;
    try {
        p = new Pool(threads);
    } catch (const std::runtime_error& e) {
        const char* env = std::getenv("FLASHATTN_NUM_THREADS");
        throw std::runtime_error(std::string("cpu engine: ") + e.what() +
                                 (requested <= 0 && env && *env
                                      ? std::string(" (FLASHATTN_NUM_THREADS=") + env + ")"
                                      : std::string()));
    }
    g_pool.store(p, std::memory_order_release);
    return *p;
}

}  // namespace

void set_num_threads(int n) {
    if (n < 1 || n > kMaxThreads)
        throw std::invalid_argument("set_num_threads: n must be in 1.." +
                                    std::to_string(kMaxThreads) + ", got " + std::to_string(n));
    pool().resize(n);
    g_requested.store(n);  // only once it holds: a fork child rebuilds what get_num_threads says
}

int num_threads() { return pool().threads(); }

void stop_if_interrupted() {
    const CurrentTask current = t_current;
    if (!current.job) return throw_if_interrupted();  // not inside a pool task
    if (current.job->check(current.by_caller)) throw Interrupted();
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& task) { pool().run(n, task); }

std::vector<PoolCallProfile> take_pool_profile() {
    std::lock_guard<std::mutex> lk(g_profile_m);
    std::vector<PoolCallProfile> out;
    out.swap(g_profile);
    return out;
}

double pool_wakeup_us(int calls) {
    // Each task works for kTask; with every thread taking one at once a call
    // lasts kTask, and what it takes beyond that is the pool's: waking the
    // workers, handing out the tasks, waiting for the last to finish.
    using clock = std::chrono::steady_clock;
    constexpr auto kTask = std::chrono::microseconds(20);
    const int n = num_threads();
    const std::function<void(int64_t)> task = [&](int64_t) {
        const auto until = clock::now() + kTask;
        while (clock::now() < until) {
        }
    };
    const auto start = clock::now();
    for (int c = 0; c < calls; ++c) parallel_for(n, task);
    const double s = std::chrono::duration<double>(clock::now() - start).count();
    return s / std::max(calls, 1) * 1e6 - 20.0;
}

}  // namespace flashattn::cpu
