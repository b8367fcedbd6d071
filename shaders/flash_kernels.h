// The shape of the attention kernels' GPU work split, shared by the .metal
// sources and the C++ plan: head-size buckets, tile sizes and threads per
// threadgroup, the function constants, and the macros that let the
// unchanged .metal files compile as C++ (metal-sim, the compile checks and
// the GPU resource gate define them before including us). C++14: the
// dialect MSL 3.x is based on.
#pragma once

#include "flash_params.h"

// Head sizes are compiled in as buckets (the register tiles must have a
// static shape); the true D is a run-time bound, so every D in 1..256 runs
// in the smallest bucket that holds it, zero-padded to the bucket in
// threadgroup memory. X is applied to each bucket.
#define FA_HEAD_BUCKETS(X) X(32) X(64) X(96) X(128) X(256)

// The storage types of q, k, v, o, do and the gradients (issue 15): X(name,
// type, arg) for each, name being the host names' dtype part (flash_fwd_f16_
// hd64) and arg passed through (a head-size bucket). bfloat needs MSL 3.1
// (the metallib is built with -std=metal3.1).
#define FA_STORAGE_TYPES(X, arg) X(f32, float, arg) X(f16, half, arg) X(bf16, bfloat, arg)

// The bucket a head size runs in; 0 when D is out of range.
FA_INLINE fa_int fa_head_bucket(fa_int D) {
    return D < 1 ? 0 : D <= 32 ? 32 : D <= 64 ? 64 : D <= 96 ? 96 : D <= 128 ? 128 : D <= 256 ? 256 : 0;
}

// Every tiled kernel runs FA_SIMDGROUPS SIMD groups of 32 threads; each
// SIMD group owns 8 rows (one 8x8 simdgroup_matrix tall): query rows in the
// forward and dQ kernels, key rows in the dK/dV kernel. So a threadgroup
// owns FA_BLOCK_ROWS rows. (MLX's steel attention: 32 query rows, 4 SIMD
// groups.) docs/metal.md gives the reasoning for every size below.
#define FA_SIMD_WIDTH 32
#define FA_SIMDGROUPS 4
#define FA_THREADS (FA_SIMDGROUPS * FA_SIMD_WIDTH)
#define FA_BLOCK_ROWS (FA_SIMDGROUPS * 8)

// Rows of the other operand staged in threadgroup memory per step, by
// head-size bucket and storage type (sizeof(T): 4 float32, 2 half/bfloat):
// keys in the forward and dQ kernels, queries in the dK/dV kernel. Each
// SIMD group holds a tile's scores (and dP, dS) as STAGE/8 fragments, so
// the stage is what the gate's 128 registers leave room for beside the
// resident rows and accumulators (docs/metal.md has the table).
#define FA_FWD_STAGE(HD, T) ((HD) <= 64 ? 32 : ((HD) <= 128 ? 16 : 8))
#define FA_DQ_STAGE(HD, T) ((HD) <= 32 ? 32 : (HD) <= 64 ? (sizeof(T) == 4 ? 16 : 32) : ((HD) <= 128 ? 16 : 8))
// (dK/dV: 8 in the SIMD-group pairs, FA_DKDV_SPLIT: with 16, the gate's
// proxy spilled the pairs' resident halves.)
#define FA_DKDV_STAGE(HD, T) ((HD) <= 32 ? 32 : FA_DKDV_SPLIT(HD, sizeof(T)) > 1 ? 8 : (HD) <= 128 ? 16 : 8)
// Row pitch of a staged tile: 16 bytes of padding (4 float32 or 8 16-bit
// elements), so the rows of a transposed 8x8 load fall in different banks
// and every row starts 16-byte aligned for the staging's vector stores.
#define FA_LD(HD, T) ((HD) + int(16 / sizeof(T)))
// Partial sums of a score over D (fa_scores): 2 halves the length of each
// float32 rounding chain.
#define FA_S_PARTIALS 2
// Partial sums of dP = dO V^T over D, and of delta = rowsum(dO o), which
// must round as dP does (a saturated row's dP - delta is then exactly 0):
// 2, so the dK/dV kernel's split halves each sum one (FA_DKDV_SPLIT).
#define FA_DP_PARTIALS 2
// Elements of the storage type in 16 bytes: the unit staging moves.
#define FA_VEC16(T) int(16 / sizeof(T))

// Which operand rows a SIMD group keeps as register fragments for the whole
// kernel (else it reloads them per step from device memory, through the
// cache): the fragments cost HD/4 registers per thread per operand, and
// Apple GPUs have at most 128. Forward: Q (and O always); dQ: Q and dO (and
// dQ); dK/dV: K and V (and dK, dV). The float32 forward at hd128 reloads Q
// (held, the gate's proxy spilled 8-148 B per lane with the score options).
#define FA_FWD_Q_IN_REGISTERS(HD, T) ((HD) <= (sizeof(T) == 4 ? 96 : 128))
#define FA_DQ_ROWS_IN_REGISTERS(HD, T) ((HD) <= 64 || FA_DQ_SPLIT(HD, sizeof(T)) > 1)
// dK/dV: every head size up to 128 (float32's hd128 pair halves of K, V,
// dK and dV take 64 of the 128 registers: the pairs keep no key index live
// across the tile loop for it, flash_bwd_dkdv).
#define FA_DKDV_ROWS_IN_REGISTERS(HD, T) ((HD) <= 128)
// The dK/dV kernel's key rows may be shared by a pair of SIMD groups, each
// owning every other 8-column block of D (d8 % 2 == its half) of K, V, dK
// and dV: half a head's fragments each, so K, V and the accumulators stay in
// registers, where one SIMD group's whole head would not fit the gate's
// 128 (docs/metal.md). Each half sums its blocks' share of S^T
// and dP^T -- exactly the forward's partial sum of that parity
// (FA_S_PARTIALS, FA_DP_PARTIALS) -- and the pair adds the two through
// threadgroup memory, so nothing is recomputed per column chunk. A
// threadgroup then owns FA_BLOCK_ROWS / SPLIT keys: hd96 and hd128 (hd64,
// 16-bit included, fits one SIMD group since the dK/dV loop is one loop over
// head and query block). BYTES: sizeof(T) (the host passes the dtype's
// size; no split depends on it now).
#define FA_DKDV_SPLIT(HD, BYTES) ((HD) >= 96 && (HD) <= 128 ? 2 : 1)
#define FA_DKDV_KEYS(HD, BYTES) (FA_BLOCK_ROWS / FA_DKDV_SPLIT(HD, BYTES))
// The dQ kernel's pairs, the same way: Q, dO and dQ halves in registers
// where one SIMD group's whole head spilled (hd96, hd128); a threadgroup
// then owns FA_DQ_ROWS query rows.
#define FA_DQ_SPLIT(HD, BYTES) ((HD) >= 96 && (HD) <= 128 ? 2 : 1)
#define FA_DQ_ROWS(HD, BYTES) (FA_BLOCK_ROWS / FA_DQ_SPLIT(HD, BYTES))
// Accumulators (O; dQ; dK and dV) cover at most a chunk of D columns per
// threadgroup: the full head where the gate finds that it fits in 128
// registers, else a launch has HD / chunk threadgroups per row block, each
// recomputing the scores for its columns (the FLOP cost is in docs/metal.md).
#define FA_FWD_DCHUNK(HD) ((HD) <= 128 ? (HD) : 128)
#define FA_DQ_DCHUNK(HD) ((HD) <= 128 ? (HD) : 64)
#define FA_DKDV_DCHUNK(HD) ((HD) <= 128 ? (HD) : 64)

// Threads of the O(T D) kernels (delta preprocess, split-KV merge): one per
// row, and one SIMD group per row, respectively.
#define FA_PREPROCESS_THREADS 64
#define FA_MERGE_ROWS_PER_GROUP 4
// Split-KV decode merges at most this many key ranges (one per lane).
#define FA_MAX_KV_SPLITS 32

// The vector decode kernel (flash_decode.metal): FA_DECODE_SIMDGROUPS SIMD
// groups per query row, each taking every FA_DECODE_SIMDGROUPS-th key; the
// plan takes it for MHA calls of at most FA_DECODE_MAX_ROWS query rows
// (core/plan.h, uses_decode_kernel), as MLX takes sdpa_vector up to 8.
#define FA_DECODE_SIMDGROUPS 4
#define FA_DECODE_THREADS (FA_DECODE_SIMDGROUPS * FA_SIMD_WIDTH)
#define FA_DECODE_MAX_ROWS 8

// Occupancy is declared: every tiled kernel (forward, dQ, dK/dV) carries
// FA_MAX_THREADS(FA_THREADS), [[max_total_threads_per_threadgroup]] on
// Metal (as MLX's steel attention declares its WM * WN * 32), so the
// compiler allocates registers for exactly that many threads. The host
// builds those pipelines with the same N and refuses one whose limit comes
// out below it (cpp/metal/device.mm; core/plan.h, declared_max_threads,
// names the kernels); metal-sim refuses a launch above it. The C++ side
// (metal-sim, the gate's proxy) has no such attribute: nothing there.
#ifndef FA_MAX_THREADS
#ifdef __METAL_VERSION__
#define FA_MAX_THREADS(n) [[max_total_threads_per_threadgroup(n)]]
#else
#define FA_MAX_THREADS(n)
#endif
#endif

// Function constants (host: cpp/core/plan.cpp, index for index).
#define FA_FC_HEAD_FULL 0  // bool: D equals the bucket: no column guards
#define FA_FC_HEAD_VEC16 1  // bool: D fills whole 16-byte vectors of the dtype (D % 4 == 0 for float32, D % 8 == 0 for 16-bit)
#define FA_FC_SCORE_MODS 2  // int: FlashParams::score_mods (0: plain attention, none of their code)
#define FA_FC_VARLEN 3  // bool: FlashParams::varlen_seqs > 0: grid.z is the sequence, read from the seqs buffer

// Threadgroup arrays are declared with FA_TG_ARRAY(type, name, count) inside
// kernels: plain `threadgroup` on Metal. The C++ side needs `static` (one
// array shared by the threads of the group, and clang only allows an address
// space on static variables), which metal-sim's <metal_stdlib> supplies.
#ifndef FA_TG_ARRAY
#define FA_TG_ARRAY(type, name, count) threadgroup type name[count]
#endif

// A program-scope [[function_constant(index)]].
#ifndef FA_FUNCTION_CONSTANT
#define FA_FUNCTION_CONSTANT(type, name, index) constant type name [[function_constant(index)]];
#endif

// Full unrolling of loops over register fragments: an array of fragments
// stays in registers only if every index is a compile-time constant.
#ifndef FA_UNROLL
#define FA_UNROLL _Pragma("clang loop unroll(full)")
#endif
// A loop kept rolled (the staging's: see fa_stage).
#ifndef FA_NO_UNROLL
#define FA_NO_UNROLL _Pragma("clang loop unroll(disable)")
#endif

// For the small wrappers around simdgroup functions in the tile loops:
// inlined first, as a call of simdgroup_load itself is, before the loops
// around it are unrolled. (A plain `inline` wrapper of simdgroup_load,
// inlined later, changed the gate proxy's register allocation: dQ hd64
// went from 117 VGPRs to 128 and spills.) MLX's METAL_FUNC is the same.
#ifndef FA_ALWAYS_INLINE
#define FA_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

// host_name on an explicit template instantiation: clang's C++ parser
// rejects the attribute there, so the C++ side defines this as nothing.
#ifndef FA_HOST_NAME
#define FA_HOST_NAME(name) [[host_name(name)]]
#endif

// Element offset of row t, head h of batch b in a (B, T, heads, D) tensor.
FA_INLINE fa_long fa_offset(fa_long sb, fa_long st, fa_long sh, fa_long b, fa_long t, fa_long h) {
    return b * sb + t * st + h * sh;
}
