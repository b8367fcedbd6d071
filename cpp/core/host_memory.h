// Host memory for outputs and large scratch: 64-byte aligned, and on Linux
// large blocks come in transparent huge pages, so that a fresh 32 MiB output
// costs 16 page faults instead of 8192 (at long T the faults of a
// windowed call's outputs were a tenth of its time).
#pragma once
#include <cstddef>

namespace flashattn {

// Uninitialised memory of at least `bytes`; throws std::bad_alloc. Free
// with std::free.
void* allocate_host(size_t bytes);

}  // namespace flashattn
