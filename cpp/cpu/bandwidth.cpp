// Read bandwidth measurement: what a memory-bound call (a decoding step
// reads every K and V row once) is quoted against. Each thread sums its own
// slice of a buffer far larger than the last-level cache, with independent
// accumulators so that the adds never limit the loads; threads are started
// here, as for the FMA peak, so that all of them run at once.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "core/host_memory.h"
#include "cpu/peak.h"
#include "cpu/thread_pool.h"

namespace flashattn::cpu {
namespace {

// 8 independent accumulators of 8 floats: the compiler vectorises each row.
float sum_slice(const float* x, size_t n) {
    float acc[8][8] = {};
    for (size_t i = 0; i + 64 <= n; i += 64)
        for (int a = 0; a < 8; ++a)
            for (int l = 0; l < 8; ++l) acc[a][l] += x[i + a * 8 + l];
    float s = 0.0f;
    for (auto& a : acc)
        for (float v : a) s += v;
    return s;
}

}  // namespace

double measure_read_bandwidth(double seconds, int threads, size_t bytes) {
    if (threads < 1) threads = num_threads();
    bytes = std::max<size_t>(bytes, size_t(threads) * 4096 * 64);
    const size_t n = bytes / sizeof(float);
    std::unique_ptr<float, decltype(&std::free)> buffer(
        static_cast<float*>(allocate_host(n * sizeof(float))), &std::free);
    using clock = std::chrono::steady_clock;
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    const size_t slice = n / size_t(threads) / 64 * 64;
    std::vector<double> read(size_t(threads), 0.0), elapsed(size_t(threads), 0.0);
    std::vector<float> sink(size_t(threads), 0.0f);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            float* x = buffer.get() + size_t(t) * slice;
            // First touch by the reader: its pages are local to it, and
            // faulting them in is not timed.
            for (size_t i = 0; i < slice; ++i) x[i] = float(i & 7);
            ready.fetch_add(1);
            while (!go.load()) std::this_thread::yield();
            const auto start = clock::now();
            double dt = 0.0, bytes_read = 0.0;
            do {
                sink[size_t(t)] += sum_slice(x, slice);
                bytes_read += double(slice) * sizeof(float);
                dt = std::chrono::duration<double>(clock::now() - start).count();
            } while (dt < seconds);
            read[size_t(t)] = bytes_read;
            elapsed[size_t(t)] = dt;
        });
    while (ready.load() < threads) std::this_thread::yield();
    go.store(true);
    for (auto& th : pool) th.join();
    double total = 0.0, wall = 0.0;
    for (int t = 0; t < threads; ++t) {
        total += read[size_t(t)];
        wall = std::max(wall, elapsed[size_t(t)]);
    }
    volatile float keep = sink[0];
    (void)keep;
    return total / wall / 1e9;
}

}  // namespace flashattn::cpu
