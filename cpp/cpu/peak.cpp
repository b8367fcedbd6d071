// FMA peak measurement, one copy per ISA (with its vector width): each
// thread runs 12 independent vector FMA chains (enough to cover the FMA
// latency on every x86 core we target) for a fixed wall time; the count of
// completed FMAs over the elapsed time is the peak. Threads are started here
// rather than taken from the pool, so that every one of them is guaranteed
// to run at the same time.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "cpu/isa_begin.h"  // opens the per-ISA region
#include "cpu/kernels.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"

FLASHATTN_CPU_KERNELS(FLASHATTN_CPU_ISA)

namespace flashattn::cpu::FLASHATTN_CPU_ISA {
namespace {

using simd::vf;
constexpr int kChains = 12;
constexpr long kInner = 1 << 16;

// Returns a value depending on every chain, and starts from `seed`, so that
// no call can be optimised away or hoisted out of the timing loop.
float fma_chains(float seed, long rounds) {
    vf acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = simd::splat(seed + 0.001f * float(i));
    const vf a = simd::splat(0.999999f), b = simd::splat(1e-7f);
    for (long r = 0; r < rounds; ++r)
        for (long it = 0; it < kInner; ++it) {
#pragma GCC unroll 12
            for (int i = 0; i < kChains; ++i) acc[i] = simd::fma(acc[i], a, b);
        }
    vf s{};
    for (int i = 0; i < kChains; ++i) s += acc[i];
    return s[0];
}

}  // namespace

double measure_fma_peak(double seconds, int threads) {
    if (threads < 1) threads = num_threads();
    using clock = std::chrono::steady_clock;
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<long> rounds(size_t(threads), 0);
    std::vector<double> elapsed(size_t(threads), 0.0);
    std::vector<float> sink(size_t(threads), 0.0f);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            ready.fetch_add(1);
            while (!go.load()) std::this_thread::yield();
            const auto start = clock::now();
            double dt = 0.0;
            long n = 0;
            do {
                sink[size_t(t)] = fma_chains(sink[size_t(t)] * 1e-3f, 4);
                n += 4;
                dt = std::chrono::duration<double>(clock::now() - start).count();
            } while (dt < seconds);
            rounds[size_t(t)] = n;
            elapsed[size_t(t)] = dt;
        });
    while (ready.load() < threads) std::this_thread::yield();
    go.store(true);
    for (auto& th : pool) th.join();
    double flops = 0.0, wall = 0.0;
    for (int t = 0; t < threads; ++t) {
        flops += double(rounds[size_t(t)]) * kInner * kChains * simd::W * 2.0;
        wall = std::max(wall, elapsed[size_t(t)]);
    }
    volatile float keep = sink[0];
    (void)keep;
    return flops / wall / 1e9;
}

int vector_width() { return simd::W; }

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA

#include "cpu/isa_end.h"
