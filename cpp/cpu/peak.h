// This machine's fused multiply-add peak and read bandwidth, measured with the engine's own
// vector width and thread count: what benchmarks quote efficiency against.
#pragma once
#include <cstddef>

namespace flashattn::cpu {

// GFLOP/s (one FMA = 2 FLOPs) of `threads` threads running independent FMA
// chains for about `seconds`. threads < 1 means num_threads().
double measure_fma_peak(double seconds, int threads);

// GB/s that `threads` threads read from a `bytes` buffer (far beyond the
// last-level cache) for about `seconds` (cpu/bandwidth.cpp).
double measure_read_bandwidth(double seconds, int threads, size_t bytes);

}  // namespace flashattn::cpu
