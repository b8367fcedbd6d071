// A host-memory stand-in for MTLBuffer, so that the metal engine's pool and
// staging (portable C++: metal/buffer_pool.h, metal/staging.h) run in tests
// on every platform: test_metal_buffer_pool and test_metal_host_sim.
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "metal/buffer_pool.h"

namespace flashattn_test {

constexpr size_t kPage = 4096;

// Host memory with the life cycle of an id<MTLBuffer>: freed with the last handle.
struct Block {
    int id;
    size_t size;
    void* data;
    std::set<int>* released;
    bool owns = true;  // false: wrapped host memory (newBufferWithBytesNoCopy), not freed here
    Block(int id_, size_t size_, std::set<int>* released_)
        : id(id_), size(size_), data(std::aligned_alloc(kPage, size_)), released(released_) {}
    Block(void* host, size_t size_) : id(-1), size(size_), data(host), released(nullptr), owns(false) {}
    ~Block() {
        if (owns) std::free(data);
        if (released) released->insert(id);
    }
};

struct HostBackend {
    using Handle = std::shared_ptr<Block>;
    std::shared_ptr<std::atomic<int>> next_id = std::make_shared<std::atomic<int>>(0);
    std::set<int>* released = nullptr;        // not thread-safe: single-threaded tests only
    std::shared_ptr<std::atomic<size_t>> live = std::make_shared<std::atomic<size_t>>(0);
    size_t capacity = SIZE_MAX;               // allocation fails past this many live bytes

    Handle allocate(size_t bytes) const {
        if (*live + bytes > capacity) return nullptr;
        *live += bytes;
        auto counter = live;
        auto* block = new Block(next_id->fetch_add(1), bytes, released);
        return Handle(block, [counter](Block* b) {
            *counter -= b->size;
            delete b;
        });
    }
    void* contents(const Handle& h) const { return h->data; }

    // Like newBufferWithBytesNoCopy: page-aligned pointer and length, else refused.
    bool can_wrap = false;
    std::shared_ptr<std::vector<std::pair<uintptr_t, size_t>>> wrapped =
        std::make_shared<std::vector<std::pair<uintptr_t, size_t>>>();
    Handle wrap(void* page, size_t bytes) const {
        if (!can_wrap || reinterpret_cast<uintptr_t>(page) % kPage != 0 || bytes % kPage != 0)
            return nullptr;
        wrapped->push_back({reinterpret_cast<uintptr_t>(page), bytes});
        return std::make_shared<Block>(page, bytes);
    }
};

using HostPool = flashattn::metal::BufferPool<HostBackend>;

}  // namespace flashattn_test
