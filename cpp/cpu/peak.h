// This machine's fused multiply-add peak, measured with the engine's own
// vector width and thread count: what benchmarks quote efficiency against.
#pragma once

namespace flashattn::cpu {

// GFLOP/s (one FMA = 2 FLOPs) of `threads` threads running independent FMA
// chains for about `seconds`. threads < 1 means num_threads().
double measure_fma_peak(double seconds, int threads);

}  // namespace flashattn::cpu
