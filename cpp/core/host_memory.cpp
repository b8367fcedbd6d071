#include "core/host_memory.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flashattn {
namespace {

// std::bad_alloc (so MemoryError in Python) that says how much was asked for.
class HostAllocationError : public std::bad_alloc {
public:
    explicit HostAllocationError(size_t bytes)
        : what_("flashattn: cannot allocate " + std::to_string(bytes) +
                " bytes of host memory") {}
    const char* what() const noexcept override { return what_.c_str(); }

private:
    std::string what_;
};

}  // namespace

void* allocate_host(size_t bytes) {
    constexpr size_t kHugePage = size_t(2) << 20;
    // Below a few huge pages the rounding would waste more than it saves.
    const bool huge = bytes >= 4 * kHugePage;
    const size_t align = huge ? kHugePage : 64;
    const size_t size = std::max(align, (bytes + align - 1) / align * align);
    void* data = std::aligned_alloc(align, size);
    if (!data) throw HostAllocationError(bytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // Advice only: where huge pages are off this fails and changes nothing.
    if (huge) (void)madvise(data, size, MADV_HUGEPAGE);
#endif
    return data;
}

}  // namespace flashattn
