// Opens the region of a kernel translation unit that is compiled for one
// instruction set. The build compiles forward.cpp, backward.cpp and peak.cpp
// once per path (cpp/cpu/CMakeLists.txt) with FLASHATTN_CPU_ISA naming it
// (avx512, avx2, baseline, neon, or native for a -march=native build); each
// copy lives in namespace flashattn::cpu::<isa>, and dispatch.cpp picks one.
//
// The instruction set is switched on by a target pragma here, not by -m
// flags on the command line, so that only the code after this point (the
// engine's own, in its per-ISA namespace) may use it. Everything shared with
// other translation units -- the standard library, the project's headers --
// is included first and so compiled for the baseline: otherwise an inline
// function such as std::vector<long>::_M_realloc_insert could be emitted with
// AVX-512 instructions, and the linker, keeping one copy of it for the whole
// library, might hand that copy to the baseline path (SIGILL on an AVX2 CPU).
//
// Include this after the file's own system includes and before any cpu/
// header; close the region with cpu/isa_end.h at the end of the file.
#ifndef FLASHATTN_CPU_ISA
#error "FLASHATTN_CPU_ISA (avx512, avx2, baseline, neon or native) must be defined"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "core/engine.h"
#include "core/host_memory.h"
#include "flash_params.h"
#include "cpu/call_phases.h"
#include "cpu/thread_pool.h"

// Which vector code simd.h and gemm.h use: FLASHATTN_SIMD_AVX512,
// FLASHATTN_SIMD_AVX2 (AVX2 + FMA), FLASHATTN_SIMD_NEON, or none of them
// (generic 4-lane vectors, whatever the compiler makes of them).
#if defined(FLASHATTN_CPU_ISA_AVX512)
#define FLASHATTN_SIMD_AVX512 1
#elif defined(FLASHATTN_CPU_ISA_AVX2)
#define FLASHATTN_SIMD_AVX2 1
#elif defined(FLASHATTN_CPU_ISA_NEON)
#if !defined(__ARM_NEON)
#error "the neon path needs an arm64 (AArch64) compiler"
#endif
#define FLASHATTN_SIMD_NEON 1  // part of the arm64 baseline: no target switch
#elif defined(FLASHATTN_CPU_ISA_NATIVE)
// -march=native on the command line decides (FLASHATTN_NATIVE=ON).
#if defined(__AVX512F__)
#define FLASHATTN_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define FLASHATTN_SIMD_AVX2 1
#elif defined(__ARM_NEON)
#define FLASHATTN_SIMD_NEON 1
#endif
#elif !defined(FLASHATTN_CPU_ISA_BASELINE)
#error "define one of FLASHATTN_CPU_ISA_{AVX512,AVX2,NEON,BASELINE,NATIVE}"
#endif

#if defined(FLASHATTN_SIMD_AVX512) || defined(FLASHATTN_SIMD_AVX2)
#include <immintrin.h>
#elif defined(FLASHATTN_SIMD_NEON)
#include <arm_neon.h>
#endif

// The feature lists match what dispatch.cpp checks before choosing a path.
#if defined(FLASHATTN_CPU_ISA_AVX512) || defined(FLASHATTN_CPU_ISA_AVX2)
#define FLASHATTN_TARGET_REGION 1
#if !defined(__GNUC__)
#error "per-ISA kernels need GCC or Clang (target pragmas)"
#elif defined(__clang__) && defined(FLASHATTN_CPU_ISA_AVX512)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c"))), apply_to = function)
#elif defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(FLASHATTN_CPU_ISA_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#endif
