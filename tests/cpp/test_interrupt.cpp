// Interrupting a running call (core/interrupt.h): the cpu pool stops
// between tasks (and long tasks between their blocks) and metal-sim between
// threadgroups and launches, each then throwing Interrupted, with the pool
// and the launcher usable afterwards; a poll that never says yes changes
// nothing; a poll may call in again (as Python's signal handlers do)
// without a deadlock; stop_all_calls() stops calls on every thread, and
// resume_calls() lets them run again.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "core/interrupt.h"
#include "cpu/thread_pool.h"
#include "sim/launcher.h"

using namespace flashattn;

namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// A task that takes a millisecond, 400 of them: 400 ms / threads uninterrupted.
int64_t tasks_run(bool interrupt) {
    std::atomic<int64_t> ran{0};
    auto task = [&](int64_t) {
        sleep_ms(1);
        ++ran;
    };
    if (interrupt) {
        InterruptScope scope([] { return true; });
        CHECK_THROWS(Interrupted, "interrupted", cpu::parallel_for(400, task));
    } else {
        InterruptScope scope([] { return false; });
        cpu::parallel_for(400, task);
    }
    return ran.load();
}

void test_pool() {
    cpu::set_num_threads(3);
    const int64_t interrupted = tasks_run(true);
    CHECK(interrupted > 0 && interrupted < 400);
    CHECK(tasks_run(false) == 400);  // the pool is whole again
    CHECK(cpu::num_threads() == 3);
    // Without a scope nothing polls.
    std::atomic<int64_t> ran{0};
    cpu::parallel_for(50, [&](int64_t) { ++ran; });
    CHECK(ran.load() == 50);
}

// Two tasks of a thousand 1 ms blocks each, checking between blocks, on
// two threads: an interrupt 50 ms in stops both within a few blocks (the
// caller's through its own poll, the worker's through the job), not after
// their second.
void test_long_tasks_stop_between_blocks() {
    cpu::set_num_threads(2);
    std::atomic<int> blocks{0};
    const auto start = std::chrono::steady_clock::now();
    {
        InterruptScope scope([&] { return std::chrono::steady_clock::now() - start >
                                          std::chrono::milliseconds(50); });
        CHECK_THROWS(Interrupted, "interrupted", cpu::parallel_for(2, [&](int64_t) {
                         for (int b = 0; b < 1000; ++b) {
                             cpu::stop_if_interrupted();
                             sleep_ms(1);
                             ++blocks;
                         }
                     }));
    }
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - start).count();
    CHECK(ms < 500.0);
    CHECK(blocks.load() < 1000);
    CHECK(tasks_run(false) == 400);  // the pool is whole again
}

// The caller waits for a worker's long task and polls meanwhile; the poll
// resizes the pool (a Python signal handler calling set_num_threads), which
// joins that worker: the wait must hold no lock the worker needs to finish.
void test_poll_may_resize_the_pool() {
    cpu::set_num_threads(2);
    std::atomic<bool> resized{false};
    std::atomic<std::thread::id> long_task_thread{};
    {
        InterruptScope scope([&] {
            if (!resized.exchange(true)) cpu::set_num_threads(3);
            return false;
        });
        // The caller's task ends once a worker has the other, which lasts.
        const std::thread::id caller = std::this_thread::get_id();
        std::atomic<bool> other_started{false};
        cpu::parallel_for(2, [&](int64_t) {
            if (std::this_thread::get_id() == caller) {
                for (int ms = 0; ms < 10000 && !other_started.load(); ++ms) sleep_ms(1);
                return;
            }
            long_task_thread = std::this_thread::get_id();
            other_started = true;
            sleep_ms(300);
        });
    }
    CHECK(resized.load() && cpu::num_threads() == 3);
    CHECK(long_task_thread.load() != std::this_thread::get_id());  // the premise
    CHECK(tasks_run(false) == 400);
}

// A kernel of one thread that sleeps a millisecond per threadgroup.
sim::Kernel slow_kernel(std::atomic<int>& groups) {
    sim::Kernel k;
    k.name = "slow";
    k.check = [](const std::vector<sim::Binding>&) { return std::string(); };
    k.run = [&groups](const std::vector<sim::Binding>&, const sim::Builtins&) {
        sleep_ms(1);
        ++groups;
    };
    return k;
}

void test_sim() {
    std::atomic<int> groups{0};
    const sim::Kernel k = slow_kernel(groups);
    {
        InterruptScope scope([] { return true; });
        CHECK_THROWS(Interrupted, "interrupted", sim::run_launch(k, {}, {400, 1, 1}, {1, 1, 1}));
        CHECK(groups.load() > 0 && groups.load() < 400);
        // Once interrupted, the next launch of the plan does not start.
        groups = 0;
        CHECK_THROWS(Interrupted, "interrupted", sim::run_launch(k, {}, {4, 1, 1}, {1, 1, 1}));
        CHECK(groups.load() == 0);
    }
    groups = 0;
    sim::run_launch(k, {}, {40, 1, 1}, {1, 1, 1});  // the launch lock was let go
    CHECK(groups.load() == 40);
}

// A poll inside a launch (a signal handler) that calls metal-sim again gets
// a runtime_error at once (it waited for the launch lock its thread held);
// the launch it polled from goes on.
void test_sim_call_from_a_poll() {
    std::atomic<int> groups{0}, inner{0};
    const sim::Kernel k = slow_kernel(groups);
    const sim::Kernel k_inner = slow_kernel(inner);
    std::string refused;
    {
        InterruptScope scope([&] {
            if (refused.empty()) {
                try {
                    sim::run_launch(k_inner, {}, {2, 1, 1}, {1, 1, 1});
                    refused = "ran";
                } catch (const std::runtime_error& e) {
                    refused = e.what();
                }
            }
            return false;
        });
        sim::run_launch(k, {}, {100, 1, 1}, {1, 1, 1});
    }
    CHECK(refused.find("one launch at a time") != std::string::npos);
    CHECK(groups.load() == 100 && inner.load() == 0);
}

void test_stop_all_calls() {
    stop_all_calls();
    CHECK(all_calls_stopped() && interrupt_requested());
    CHECK_THROWS(Interrupted, "interrupted", cpu::parallel_for(4, [](int64_t) {}));
    std::atomic<int> groups{0};
    const sim::Kernel k = slow_kernel(groups);
    CHECK_THROWS(Interrupted, "interrupted", sim::run_launch(k, {}, {4, 1, 1}, {1, 1, 1}));
    // The exit hook undoes the stop once the calls it stopped have ended.
    resume_calls();
    CHECK(!all_calls_stopped() && !interrupt_requested());
    CHECK(tasks_run(false) == 400);
    sim::run_launch(k, {}, {4, 1, 1}, {1, 1, 1});
    CHECK(groups.load() == 4);
}

}  // namespace

int main() {
    test_pool();
    test_long_tasks_stop_between_blocks();
    test_poll_may_resize_the_pool();
    test_sim();
    test_sim_call_from_a_poll();
    test_stop_all_calls();
    return flashattn_test::finish("test_interrupt");
}
