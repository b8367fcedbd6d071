// The persistent worker pool behind flashattn::cpu::parallel_for. Jobs sit in
// a queue; workers and the submitting thread claim task indices with an atomic
// counter, so a call always finishes even with no worker free (or none at all).
#include "cpu/thread_pool.h"

#include <pthread.h>

#include <atomic>
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

namespace flashattn::cpu {
namespace {

struct Job {
    const std::function<void(int64_t)>* task = nullptr;
    int64_t n = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex m;  // guards error and the wake-up of the submitter
    std::condition_variable finished;
    std::exception_ptr error;

    // Claims and runs tasks until none is left to claim.
    void work() {
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
            try {
                (*task)(i);
            } catch (...) {
                std::lock_guard<std::mutex> lk(m);
                if (!error) error = std::current_exception();
            }
            if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
                std::lock_guard<std::mutex> lk(m);
                finished.notify_all();
            }
        }
    }
};

int threads_from_environment() {
    const char* env = std::getenv("FLASHATTN_NUM_THREADS");
    if (env && *env) {
        char* end = nullptr;
        const long n = std::strtol(env, &end, 10);
        if (*end != '\0' || n < 1 || n > 4096)
            throw std::invalid_argument(
                std::string("FLASHATTN_NUM_THREADS must be a positive integer, got '") + env +
                "'");
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

    void resize(int threads) {
        std::lock_guard<std::mutex> lk(resize_m_);
        if (threads == threads_.load()) return;
        stop();
        start(threads);
    }

    void run(int64_t n, const std::function<void(int64_t)>& task) {
        if (n <= 0) return;
        auto job = std::make_shared<Job>();
        job->task = &task;
        job->n = n;
        if (n > 1 && threads_.load() > 1) {
            std::lock_guard<std::mutex> lk(m_);
            queue_.push_back(job);
            wake_.notify_all();
        }
        job->work();
        {
            std::unique_lock<std::mutex> lk(job->m);
            job->finished.wait(lk, [&] { return job->done.load() == n; });
        }
        retire(job);
        if (job->error) std::rethrow_exception(job->error);
    }

private:
    void start(int threads) {
        std::lock_guard<std::mutex> lk(m_);
        stopping_ = false;
        threads_.store(threads);
        for (int t = 1; t < threads; ++t) workers_.emplace_back([this] { loop(); });
    }

    void stop() {
        {
            std::lock_guard<std::mutex> lk(m_);
            stopping_ = true;
            wake_.notify_all();
        }
        for (auto& w : workers_) w.join();
        workers_.clear();
    }

    void retire(const std::shared_ptr<Job>& job) {
        std::lock_guard<std::mutex> lk(m_);
        for (auto it = queue_.begin(); it != queue_.end(); ++it)
            if (*it == job) {
                queue_.erase(it);
                break;
            }
    }

    void loop() {
        std::unique_lock<std::mutex> lk(m_);
        for (;;) {
            wake_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
            if (stopping_) return;
            std::shared_ptr<Job> job = queue_.front();
            // An exhausted job leaves the queue so idle workers sleep again.
            if (job->next.load(std::memory_order_relaxed) >= job->n) {
                queue_.pop_front();
                continue;
            }
            lk.unlock();
            job->work();
            lk.lock();
        }
    }

    std::mutex resize_m_;
    std::mutex m_;
    std::condition_variable wake_;
    std::deque<std::shared_ptr<Job>> queue_;
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
    Pool* p = new Pool(requested > 0 ? requested : threads_from_environment());
    g_pool.store(p, std::memory_order_release);
    return *p;
}

}  // namespace

void set_num_threads(int n) {
    if (n < 1)
        throw std::invalid_argument("set_num_threads: n must be at least 1, got " +
                                    std::to_string(n));
    g_requested.store(n);
    pool().resize(n);
}

int num_threads() { return pool().threads(); }

void parallel_for(int64_t n, const std::function<void(int64_t)>& task) { pool().run(n, task); }

}  // namespace flashattn::cpu
