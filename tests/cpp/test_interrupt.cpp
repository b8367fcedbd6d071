// Interrupting a running call (core/interrupt.h): the cpu pool stops
// between tasks and metal-sim between threadgroups and launches, each then
// throwing Interrupted, with the pool and the launcher usable afterwards;
// a poll that never says yes changes nothing; stop_all_calls() stops calls
// on every thread.
#include <atomic>
#include <chrono>
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

void test_stop_all_calls() {  // last: it cannot be undone
    stop_all_calls();
    CHECK(all_calls_stopped() && interrupt_requested());
    CHECK_THROWS(Interrupted, "interrupted", cpu::parallel_for(4, [](int64_t) {}));
    std::atomic<int> groups{0};
    const sim::Kernel k = slow_kernel(groups);
    CHECK_THROWS(Interrupted, "interrupted", sim::run_launch(k, {}, {4, 1, 1}, {1, 1, 1}));
}

}  // namespace

int main() {
    test_pool();
    test_sim();
    test_stop_all_calls();
    return flashattn_test::finish("test_interrupt");
}
