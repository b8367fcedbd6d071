// The cpu engine's one persistent thread pool: a fixed set of workers that
// several concurrent callers share, each caller also working on its own job.
#pragma once
#include <cstdint>
#include <functional>

namespace flashattn::cpu {

// Threads a call may use, the caller included. The default is the machine's
// hardware threads, or FLASHATTN_NUM_THREADS when set (read at first use).
// n < 1 throws std::invalid_argument.
void set_num_threads(int n);
int num_threads();

// Runs task(i) for every i in [0, n): on the pool's workers and on the calling
// thread, which returns once all are done. Tasks must write disjoint memory;
// which thread runs a task never changes what it computes. The first exception
// a task throws is rethrown here (the remaining tasks still run).
void parallel_for(int64_t n, const std::function<void(int64_t)>& task);

}  // namespace flashattn::cpu
