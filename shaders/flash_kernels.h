// The shape of the attention kernels' GPU work split, shared by the .metal
// sources and the C++ plan: threads per threadgroup, tile sizes, head-size
// buckets, and the two macros that let the unchanged .metal files compile
// as C++ (metal-sim and the compile checks define them before including us).
#pragma once

#include "flash_params.h"

// Rows (query rows for forward and dQ, key rows for dK/dV) per threadgroup,
// one GPU thread per row: two SIMD groups of 32.
#define FA_ROWS_PER_GROUP 64

// Rows of the other side staged in threadgroup memory per step. Two
// [FA_TILE(HD) x HD] float tiles are staged at a time: 8, 16, 12, 16, 16 KiB
// for the buckets below, at most half of Apple's 32 KiB, so two threadgroups
// can be resident per core.
#define FA_TILE(HD) ((HD) <= 64 ? 32 : ((HD) <= 128 ? 16 : 8))

// Head sizes are compiled in as buckets (register arrays must have a static
// size); the true D is a run-time loop bound, so every D in 1..256 runs
// fused in the smallest bucket that holds it. X is applied to each bucket.
#define FA_HEAD_BUCKETS(X) X(32) X(64) X(96) X(128) X(256)

// The bucket a head size runs in; 0 when D is out of range.
FA_INLINE fa_int fa_head_bucket(fa_int D) {
    return D < 1 ? 0 : D <= 32 ? 32 : D <= 64 ? 64 : D <= 96 ? 96 : D <= 128 ? 128 : D <= 256 ? 256 : 0;
}

// Threadgroup arrays are declared with FA_TG_ARRAY(type, name, count) inside
// kernels: plain `threadgroup` on Metal. The C++ side needs `static` (one
// array shared by the threads of the group, and clang only allows an address
// space on static variables), which metal-sim's <metal_stdlib> supplies.
#ifndef FA_TG_ARRAY
#define FA_TG_ARRAY(type, name, count) threadgroup type name[count]
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
