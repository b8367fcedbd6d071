// The metal engine's buffer pool, as portable C++ templated on the buffer
// handle, so that its bookkeeping (page rounding, best-fit reuse, LRU eviction
// past a byte cap, counters, the address index of buffers handed out) is
// compiled and tested on every platform; cpp/metal/engine.mm instantiates it
// with id<MTLBuffer>.
//
// A Backend supplies
//   using Handle = ...;                      // copyable; false when empty
//   Handle allocate(size_t bytes);           // an empty Handle on failure
//   void* contents(const Handle&);           // CPU address of the buffer
//   Handle wrap(void* page, size_t bytes);   // host memory (page aligned, whole pages)
//                                            // bound in place, no copy; empty if not possible
// and memory is released by dropping the last Handle (as ARC does for an
// id<MTLBuffer>, or a shared_ptr in the tests).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace flashattn::metal {

// Thrown when a buffer cannot be had: a std::bad_alloc (MemoryError in
// Python, as for every engine) that says how much was asked for.
class OutOfMemory : public std::bad_alloc {
public:
    explicit OutOfMemory(std::string message) : message_(std::move(message)) {}
    const char* what() const noexcept override { return message_.c_str(); }

private:
    std::string message_;
};

struct PoolStats {
    size_t page_size = 0;
    size_t cache_limit = 0;        // cached (idle) bytes kept at most
    size_t active_bytes = 0;       // handed out and not yet returned
    size_t active_buffers = 0;
    size_t peak_active_bytes = 0;
    size_t cached_bytes = 0;       // idle, kept for reuse
    size_t cached_buffers = 0;
    uint64_t allocations = 0;      // new buffers asked of the backend
    uint64_t reuses = 0;           // requests served from the cache
    uint64_t evictions = 0;        // cached buffers dropped for the cap or clear_cache
};

template <class Backend>
class BufferPool : public std::enable_shared_from_this<BufferPool<Backend>> {
public:
    using Handle = typename Backend::Handle;

    // A buffer handed out. The last shared_ptr to it returns the buffer to the
    // pool, and keeps the pool alive until then.
    struct Lease {
        Handle handle;
        void* data = nullptr;
        size_t size = 0;  // page-rounded, >= the bytes asked for
    };

    // Where an address handed in lies: in this pool buffer, at this offset.
    struct Location {
        Handle handle;
        size_t offset = 0;
    };

    static std::shared_ptr<BufferPool> create(Backend backend, size_t page_size,
                                              size_t cache_limit) {
        return std::shared_ptr<BufferPool>(
            new BufferPool(std::move(backend), page_size, cache_limit));
    }

    size_t page_size() const { return page_; }

    // Whole pages, at least one: reuse then compares like with like, and the
    // backend is never asked for zero bytes.
    size_t round_size(size_t bytes) const {
        if (bytes > SIZE_MAX - page_)
            throw OutOfMemory("metal: cannot allocate " + std::to_string(bytes) + " bytes");
        return std::max(page_, (bytes + page_ - 1) / page_ * page_);
    }

    // A cached buffer of size s serves a request of `size` bytes only when s is
    // not much bigger (at most 1/8 more, or two pages, and never double), so
    // small requests cannot pin large buffers.
    static bool fits(size_t size, size_t cached, size_t page) {
        const size_t slack = std::min(size, std::max(2 * page, size / 8));
        return cached >= size && cached - size <= slack;
    }

    std::shared_ptr<Lease> acquire(size_t bytes) {
        const size_t size = round_size(bytes);
        Handle handle = take_cached(size);
        if (!handle) handle = allocate_new(size);
        std::unique_ptr<Lease> lease(new Lease{handle, backend_.contents(handle), size});
        {
            std::lock_guard<std::mutex> lock(mu_);
            active_.emplace(address(lease->data), Active{handle, size});
            stats_.active_bytes += size;
            stats_.active_buffers += 1;
            stats_.peak_active_bytes = std::max(stats_.peak_active_bytes, stats_.active_bytes);
        }
        // From here the deleter owns the lease: shared_ptr runs it even if
        // allocating the control block fails, so the books stay balanced.
        auto self = this->shared_from_this();
        return std::shared_ptr<Lease>(lease.release(), [self](Lease* l) {
            self->give_back(*l);
            delete l;
        });
    }

    // The pool buffer handed out that holds all of [p, p + bytes), if any.
    std::optional<Location> find(const void* p, size_t bytes) const {
        const uintptr_t a = address(p);
        std::lock_guard<std::mutex> lock(mu_);
        auto it = active_.upper_bound(a);
        if (it == active_.begin()) return std::nullopt;
        --it;
        const uintptr_t base = it->first;
        const size_t size = it->second.size;
        if (a - base >= size || bytes > size - (a - base)) return std::nullopt;
        return Location{it->second.handle, size_t(a - base)};
    }

    // Host memory [p, p + bytes) outside the pool, bound in place by the
    // backend over the whole pages it touches (Metal's newBufferWithBytesNoCopy
    // needs a page-aligned pointer and length): the handle and p's offset in
    // it, or nullopt when the backend cannot. Not pool memory: not counted,
    // never cached; it lives as long as the returned handle.
    std::optional<Location> wrap(const void* p, size_t bytes) const {
        const uintptr_t a = address(p);
        const uintptr_t start = a / page_ * page_;
        if (bytes > SIZE_MAX - page_ - (a - start)) return std::nullopt;
        const size_t length = (a - start + bytes + page_ - 1) / page_ * page_;
        Handle handle = backend_.wrap(reinterpret_cast<void*>(start), length);
        if (!handle) return std::nullopt;
        return Location{handle, size_t(a - start)};
    }

    PoolStats stats() const {
        std::lock_guard<std::mutex> lock(mu_);
        return stats_;
    }

    // Drops every idle buffer; buffers handed out are not affected.
    void clear_cache() {
        std::vector<Handle> dropped;  // released after the lock is let go
        {
            std::lock_guard<std::mutex> lock(mu_);
            evict_to(0, dropped);
        }
    }

    // Returns the previous limit; evicts at once down to the new one.
    size_t set_cache_limit(size_t bytes) {
        std::vector<Handle> dropped;
        std::lock_guard<std::mutex> lock(mu_);
        const size_t previous = stats_.cache_limit;
        stats_.cache_limit = bytes;
        evict_to(bytes, dropped);
        return previous;
    }

private:
    struct Active {
        Handle handle;
        size_t size;
    };
    struct Cached {
        Handle handle;
        size_t size;
    };
    using LruList = std::list<Cached>;  // front: most recently returned

    BufferPool(Backend backend, size_t page_size, size_t cache_limit)
        : backend_(std::move(backend)), page_(page_size ? page_size : 4096) {
        stats_.page_size = page_;
        stats_.cache_limit = cache_limit;
    }

    static uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

    Handle take_cached(size_t size) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = by_size_.lower_bound(size);  // best fit: the smallest that is big enough
        if (it == by_size_.end() || !fits(size, it->first, page_)) return Handle{};
        Handle handle = it->second->handle;
        stats_.cached_bytes -= it->first;
        stats_.cached_buffers -= 1;
        stats_.reuses += 1;
        lru_.erase(it->second);
        by_size_.erase(it);
        return handle;
    }

    Handle allocate_new(size_t size) {
        Handle handle = backend_.allocate(size);
        if (!handle) {  // memory may be held by idle buffers: drop them and try once more
            clear_cache();
            handle = backend_.allocate(size);
        }
        if (!handle)
            throw OutOfMemory("metal: could not allocate a buffer of " + std::to_string(size) +
                              " bytes (" + std::to_string(stats().active_bytes) +
                              " bytes in use by live arrays)");
        std::lock_guard<std::mutex> lock(mu_);
        stats_.allocations += 1;
        return handle;
    }

    void give_back(const Lease& lease) {
        std::vector<Handle> dropped;
        std::lock_guard<std::mutex> lock(mu_);
        active_.erase(address(lease.data));
        stats_.active_bytes -= lease.size;
        stats_.active_buffers -= 1;
        lru_.push_front(Cached{lease.handle, lease.size});
        by_size_.emplace(lease.size, lru_.begin());
        stats_.cached_bytes += lease.size;
        stats_.cached_buffers += 1;
        evict_to(stats_.cache_limit, dropped);
    }

    // Least recently returned first. Caller holds mu_; the handles go to
    // `dropped` so that the memory is released after the lock.
    void evict_to(size_t limit, std::vector<Handle>& dropped) {
        while (stats_.cached_bytes > limit && !lru_.empty()) {
            auto last = std::prev(lru_.end());
            auto range = by_size_.equal_range(last->size);
            for (auto it = range.first; it != range.second; ++it)
                if (it->second == last) {
                    by_size_.erase(it);
                    break;
                }
            stats_.cached_bytes -= last->size;
            stats_.cached_buffers -= 1;
            stats_.evictions += 1;
            dropped.push_back(std::move(last->handle));
            lru_.erase(last);
        }
    }

    Backend backend_;
    const size_t page_;
    mutable std::mutex mu_;
    PoolStats stats_;
    std::map<uintptr_t, Active> active_;  // by CPU address, for find()
    LruList lru_;
    std::multimap<size_t, typename LruList::iterator> by_size_;
};

}  // namespace flashattn::metal
