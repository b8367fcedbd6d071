// The cpu engine's one persistent thread pool: a fixed set of workers that
// several concurrent callers share, each caller also working on its own job.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace flashattn::cpu {

// The most threads set_num_threads and FLASHATTN_NUM_THREADS take.
constexpr int kMaxThreads = 1024;

// Threads a call may use, the caller included. The default is the machine's
// hardware threads, or FLASHATTN_NUM_THREADS when set (read at first use).
// n outside 1..kMaxThreads throws std::invalid_argument. Waits for the
// running calls' tasks; when the system cannot start n threads, throws
// std::runtime_error and keeps the old count (num_threads() says what holds).
void set_num_threads(int n);
int num_threads();

// Runs task(i) for every i in [0, n): on the pool's workers and on the calling
// thread, which returns once all are done. Tasks must write disjoint memory;
// which thread runs a task never changes what it computes. The first exception
// a task throws is rethrown here (the remaining tasks still run). Between
// tasks the calling thread checks interrupt_requested() (core/interrupt.h):
// then the tasks not yet started are skipped, the started ones stop at their
// next stop_if_interrupted(), and Interrupted is thrown.
void parallel_for(int64_t n, const std::function<void(int64_t)>& task);

// For long tasks, between blocks of their work (a block of keys): throws
// Interrupted once the task's call is to stop (Ctrl-C, seen by the calling
// thread's poll, which this runs on that thread; or interpreter exit), so
// that no task holds an interrupt up for more than one block; parallel_for
// takes it as the call's interrupt. Outside a task, throw_if_interrupted().
// Costs a few loads (and, on the calling thread, a clock read).
void stop_if_interrupted();

// What each parallel_for did, for profiling (bench/issue36_probe.py):
// recorded only while FLASHATTN_CPU_PROFILE=1 was set at the pool's first
// use, else nothing is timed. Per call: its tasks, the threads the pool had,
// wall seconds, the seconds its tasks ran summed over the threads, and the
// longest task's seconds.
struct PoolCallProfile {
    int64_t tasks;
    int threads;
    double wall_s, busy_s, longest_s;
};
// The calls recorded since the last take (oldest first), and forgets them.
std::vector<PoolCallProfile> take_pool_profile();

// Mean microseconds that a parallel_for of one 20 us task per thread takes
// beyond 20 us, over `calls` calls: what waking the pool and waiting for it
// cost a small call (the bench's probe).
double pool_wakeup_us(int calls);

}  // namespace flashattn::cpu
