#include "core/host_memory.h"

#include <algorithm>
#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flashattn {

void* allocate_host(size_t bytes) {
    constexpr size_t kHugePage = size_t(2) << 20;
    // Below a few huge pages the rounding would waste more than it saves.
    const bool huge = bytes >= 4 * kHugePage;
    const size_t align = huge ? kHugePage : 64;
    const size_t size = std::max(align, (bytes + align - 1) / align * align);
    void* data = std::aligned_alloc(align, size);
    if (!data) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // Advice only: where huge pages are off this fails and changes nothing.
    if (huge) (void)madvise(data, size, MADV_HUGEPAGE);
#endif
    return data;
}

}  // namespace flashattn
