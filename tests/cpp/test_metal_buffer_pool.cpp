// The metal engine's pool bookkeeping and staging rules, run on any platform
// with a host-memory backend standing in for MTLBuffer: page rounding,
// best-fit reuse, LRU eviction past the cap, counters, the address index,
// thread safety, and which inputs are used in place and which copied once.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "check.h"
#include "core/params.h"
#include "metal/buffer_pool.h"
#include "metal/staging.h"
#include "metal_host_backend.h"

using namespace flashattn;
using namespace flashattn::metal;
using namespace flashattn_test;

namespace {

int id_of(const std::shared_ptr<HostPool::Lease>& lease) { return lease->handle->id; }

void test_rounding_and_fit() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    CHECK(pool->round_size(0) == kPage);
    CHECK(pool->round_size(1) == kPage);
    CHECK(pool->round_size(kPage) == kPage);
    CHECK(pool->round_size(kPage + 1) == 2 * kPage);
    // Slack: two pages or 1/8, whichever is more, but never double.
    CHECK(HostPool::fits(kPage, kPage, kPage));
    CHECK(HostPool::fits(kPage, 2 * kPage, kPage));
    CHECK(!HostPool::fits(kPage, 3 * kPage, kPage));
    CHECK(HostPool::fits(100 * kPage, 112 * kPage, kPage));
    CHECK(!HostPool::fits(100 * kPage, 113 * kPage, kPage));
    CHECK(!HostPool::fits(2 * kPage, kPage, kPage));
}

void test_reuse_and_counters() {
    std::set<int> released;
    HostBackend backend;
    backend.released = &released;
    auto pool = HostPool::create(backend, kPage, 1 << 30);

    auto a = pool->acquire(100);
    CHECK(a->size == kPage);
    CHECK(reinterpret_cast<uintptr_t>(a->data) % kPage == 0);
    PoolStats s = pool->stats();
    CHECK(s.active_bytes == kPage && s.active_buffers == 1 && s.allocations == 1);
    CHECK(s.cached_bytes == 0 && s.reuses == 0);

    void* first = a->data;
    a.reset();
    s = pool->stats();
    CHECK(s.active_bytes == 0 && s.cached_bytes == kPage && s.cached_buffers == 1);
    CHECK(s.peak_active_bytes == kPage);

    auto b = pool->acquire(kPage);  // same rounded size: served from the cache
    CHECK(b->data == first);
    s = pool->stats();
    CHECK(s.allocations == 1 && s.reuses == 1 && s.cached_bytes == 0);
    CHECK(released.empty());
}

void test_best_fit() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    auto p1 = pool->acquire(1 * kPage);
    auto p4 = pool->acquire(4 * kPage);
    auto p8 = pool->acquire(8 * kPage);
    const int id4 = id_of(p4), id8 = id_of(p8);
    p1.reset(), p4.reset(), p8.reset();

    auto x = pool->acquire(3 * kPage + 1);  // 4 pages: exactly the 4-page buffer
    CHECK(id_of(x) == id4);
    auto y = pool->acquire(2 * kPage);      // only the 8-page one is left bigger: too big
    CHECK(id_of(y) != id8);
    CHECK(pool->stats().allocations == 4);
    auto z = pool->acquire(7 * kPage);      // 8 pages for 7: within two pages
    CHECK(id_of(z) == id8);
    CHECK(pool->stats().reuses == 2);
}

void test_lru_eviction_and_limits() {
    std::set<int> released;
    HostBackend backend;
    backend.released = &released;
    auto pool = HostPool::create(backend, kPage, 3 * kPage);

    std::vector<std::shared_ptr<HostPool::Lease>> leases;
    for (int i = 0; i < 4; ++i) leases.push_back(pool->acquire(kPage));
    std::vector<int> ids;
    for (auto& l : leases) ids.push_back(id_of(l));
    for (auto& l : leases) l.reset();  // returned in order 0, 1, 2, 3

    // The cap holds three pages: the least recently returned (0) was dropped.
    PoolStats s = pool->stats();
    CHECK(s.cached_bytes == 3 * kPage && s.cached_buffers == 3 && s.evictions == 1);
    CHECK(released == std::set<int>{ids[0]});

    CHECK(pool->set_cache_limit(kPage) == 3 * kPage);
    CHECK(released == (std::set<int>{ids[0], ids[1], ids[2]}));  // 1 and 2 older than 3
    CHECK(pool->stats().cached_bytes == kPage);
    CHECK(pool->stats().cache_limit == kPage);

    pool->clear_cache();
    s = pool->stats();
    CHECK(s.cached_bytes == 0 && s.cached_buffers == 0 && s.evictions == 4);
    CHECK(released.size() == 4);

    // Limit 0: nothing is kept, a returned buffer is released at once.
    pool->set_cache_limit(0);
    auto l = pool->acquire(1);
    const int id = id_of(l);
    l.reset();
    CHECK(released.count(id) == 1);
    CHECK(pool->stats().cached_bytes == 0);
}

void test_find() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    auto lease = pool->acquire(2 * kPage);
    char* base = static_cast<char*>(lease->data);

    auto at = pool->find(base + 100, 400);
    CHECK(at && at->offset == 100 && at->handle == lease->handle);
    CHECK(pool->find(base, 2 * kPage).has_value());
    CHECK(!pool->find(base + 100, 2 * kPage).has_value());  // runs past the end
    CHECK(!pool->find(base + 2 * kPage, 4).has_value());
    CHECK(!pool->find(base - 4, 4).has_value());

    std::vector<float> host(16);
    CHECK(!pool->find(host.data(), 16).has_value());

    lease.reset();  // returned to the cache: no longer an array's memory
    CHECK(!pool->find(base + 100, 4).has_value());
}

void test_allocation_failure() {
    HostBackend backend;
    backend.capacity = 4 * kPage;
    auto pool = HostPool::create(backend, kPage, 1 << 30);
    pool->acquire(4 * kPage).reset();  // 4 pages idle in the cache, the backend full
    // One page does not fit beside them, nor may it take the 4-page buffer:
    // the pool drops its cache and tries again.
    auto one = pool->acquire(kPage);
    CHECK(one && pool->stats().cached_bytes == 0 && pool->stats().evictions == 1);
    CHECK(pool->stats().allocations == 2 && pool->stats().reuses == 0);
    CHECK_THROWS(std::bad_alloc, "could not allocate", pool->acquire(4 * kPage));
    CHECK_THROWS(OutOfMemory, "cannot allocate", pool->acquire(SIZE_MAX - 1));
    CHECK(pool->stats().active_bytes == kPage);
}

void test_lease_outlives_pool() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    auto lease = pool->acquire(10);
    std::memset(lease->data, 1, 10);
    pool.reset();   // the engine is gone; the array is not
    lease.reset();  // returns its buffer to the pool it kept alive (ASan checks)
    CHECK(true);
}

void test_threads() {
    auto pool = HostPool::create(HostBackend{}, kPage, 16 * kPage);
    constexpr int kThreads = 4, kRounds = 2000;
    std::vector<std::thread> threads;
    std::atomic<int> bad{0};
    for (int t = 0; t < kThreads; ++t)
        threads.emplace_back([&, t] {
            std::mt19937 rng(t);
            std::vector<std::shared_ptr<HostPool::Lease>> held;
            for (int r = 0; r < kRounds; ++r) {
                auto l = pool->acquire((rng() % 6 + 1) * kPage - rng() % 100);
                std::memset(l->data, t, l->size);  // a buffer handed to two threads at once would clash
                if (!pool->find(l->data, l->size)) ++bad;
                held.push_back(std::move(l));
                if (held.size() > 3) {
                    const unsigned char* d = static_cast<unsigned char*>(held.front()->data);
                    if (d[0] != t || d[held.front()->size - 1] != t) ++bad;
                    held.erase(held.begin());
                }
            }
        });
    for (auto& th : threads) th.join();
    CHECK(bad == 0);
    PoolStats s = pool->stats();
    CHECK(s.active_bytes == 0 && s.active_buffers == 0);
    CHECK(s.allocations + s.reuses == uint64_t(kThreads) * kRounds);
    CHECK(s.cached_bytes <= 16 * kPage);
}

// ---- staging: which arrays are bound in place, which are copied once

TensorView view(const float* data, std::vector<int64_t> shape, std::vector<int64_t> strides) {
    return TensorView{data, std::move(shape), std::move(strides)};
}

std::vector<int64_t> contiguous(const std::vector<int64_t>& shape) {
    std::vector<int64_t> s(shape.size(), 1);
    for (int a = int(shape.size()) - 2; a >= 0; --a) s[a] = s[a + 1] * shape[a + 1];
    return s;
}

const float* bound_data(const HostPool::Handle& h, size_t offset) {
    return reinterpret_cast<const float*>(static_cast<const char*>(h->data) + offset);
}

void test_stage_host_inputs() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    const int64_t B = 2, Tq = 5, Tk = 7, H = 4, Hkv = 2, D = 3;
    // q is a slice of a host qkv array (strided); k and v are plain host arrays.
    std::vector<float> qkv(B * Tq * 3 * H * D), k(B * Tk * Hkv * D), v(k.size());
    for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = float(i);
    for (size_t i = 0; i < k.size(); ++i) k[i] = 1000.0f + float(i), v[i] = -float(i);
    const std::vector<int64_t> q_strides = {Tq * 3 * H * D, 3 * H * D, D, 1};
    const std::vector<int64_t> kv_shape = {B, Tk, Hkv, D};
    FlashParams p = make_forward_params(view(qkv.data(), {B, Tq, H, D}, q_strides),
                                        view(k.data(), kv_shape, contiguous(kv_shape)),
                                        view(v.data(), kv_shape, contiguous(kv_shape)), {});
    std::vector<float> o(B * Tq * H * D, 0.0f), lse(B * H * Tq, 0.0f);
    ForwardIO io{qkv.data(), k.data(), v.data(), o.data(), lse.data()};

    auto call = CallBuffers<HostPool>::forward(*pool, p, io);
    const TransferStats& t = call.transfers();
    CHECK(t.inputs_in_place == 0 && t.input_copies == 3);
    CHECK(t.input_copy_bytes == uint64_t(B * Tq * H * D + 2 * k.size()) * sizeof(float));
    CHECK(t.output_copies == 2 && t.outputs_in_place == 0);

    // q was compacted and its strides now say so; k and v kept theirs.
    const FlashParams& cp = call.params();
    CHECK(cp.q.b == Tq * H * D && cp.q.t == H * D && cp.q.h == D);
    CHECK(cp.k.b == p.k.b && cp.k.t == p.k.t && cp.v.h == p.v.h);
    const auto& qb = call.binding(Slot::q);
    CHECK(qb.bound && qb.offset == 0);
    const float* qd = bound_data(qb.handle, qb.offset);
    bool q_ok = true;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Tq; ++i)
            for (int64_t h = 0; h < H; ++h)
                for (int64_t d = 0; d < D; ++d)
                    q_ok &= qd[((b * Tq + i) * H + h) * D + d] ==
                            qkv[b * q_strides[0] + i * q_strides[1] + h * D + d];
    CHECK(q_ok);
    CHECK(std::memcmp(bound_data(call.binding(Slot::v).handle, 0), v.data(),
                      v.size() * sizeof(float)) == 0);

    // What the GPU writes into the bound output buffers reaches o and lse at finish().
    auto* od = const_cast<float*>(bound_data(call.binding(Slot::o).handle, 0));
    auto* ld = const_cast<float*>(bound_data(call.binding(Slot::lse).handle, 0));
    for (size_t i = 0; i < o.size(); ++i) od[i] = float(i) + 0.5f;
    for (size_t i = 0; i < lse.size(); ++i) ld[i] = -float(i);
    call.finish();
    CHECK(o[0] == 0.5f && o.back() == float(o.size() - 1) + 0.5f);
    CHECK(lse[1] == -1.0f && lse.back() == -float(lse.size() - 1));
    CHECK(!call.binding(Slot::dq).bound && !call.binding(Slot::delta).bound);
}

// A float16 call (issue 15): 2-byte elements copied compactly, spans,
// offsets and copy-backs counted in bytes of the dtype; lse stays float32.
void test_stage_half_inputs() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    const int64_t B = 2, Tq = 5, Tk = 7, H = 4, Hkv = 2, D = 3;
    std::vector<uint16_t> qkv(B * Tq * 3 * H * D), k(B * Tk * Hkv * D), v(k.size());
    for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = uint16_t(i);
    for (size_t i = 0; i < k.size(); ++i) k[i] = uint16_t(1000 + i), v[i] = uint16_t(3000 + i);
    const std::vector<int64_t> q_strides = {Tq * 3 * H * D, 3 * H * D, D, 1};
    const std::vector<int64_t> kv_shape = {B, Tk, Hkv, D};
    TensorView qv{qkv.data(), {B, Tq, H, D}, q_strides}, kv{k.data(), kv_shape, contiguous(kv_shape)};
    qv.dtype = kv.dtype = DType::f16;
    FlashParams p = make_forward_params(qv, kv, kv, {});
    std::vector<uint16_t> o(B * Tq * H * D, 0);
    std::vector<float> lse(B * H * Tq, 0.0f);
    ForwardIO io{qkv.data(), k.data(), v.data(), o.data(), lse.data()};
    io.dtype = DType::f16;

    auto call = CallBuffers<HostPool>::forward(*pool, p, io);
    const TransferStats& t = call.transfers();
    CHECK(t.input_copies == 3);
    CHECK(t.input_copy_bytes == uint64_t(B * Tq * H * D + 2 * k.size()) * 2);
    const FlashParams& cp = call.params();
    CHECK(cp.q.b == Tq * H * D && cp.q.t == H * D && cp.q.h == D);
    const auto* qd = reinterpret_cast<const uint16_t*>(
        static_cast<const char*>(call.binding(Slot::q).handle->data) + call.binding(Slot::q).offset);
    bool q_ok = true;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Tq; ++i)
            for (int64_t h = 0; h < H; ++h)
                for (int64_t d = 0; d < D; ++d)
                    q_ok &= qd[((b * Tq + i) * H + h) * D + d] ==
                            qkv[b * q_strides[0] + i * q_strides[1] + h * D + d];
    CHECK(q_ok);
    CHECK(std::memcmp(call.binding(Slot::v).handle->data, v.data(), v.size() * 2) == 0);

    auto* od = static_cast<uint16_t*>(call.binding(Slot::o).handle->data);
    auto* ld = static_cast<float*>(call.binding(Slot::lse).handle->data);
    for (size_t i = 0; i < o.size(); ++i) od[i] = uint16_t(7 + i);
    for (size_t i = 0; i < lse.size(); ++i) ld[i] = -float(i);
    call.finish();
    CHECK(o[0] == 7 && o.back() == uint16_t(7 + o.size() - 1));
    CHECK(lse.back() == -float(lse.size() - 1));
    CHECK(t.output_copy_bytes == uint64_t(o.size() * 2 + lse.size() * 4));

    // Pool memory in place: offsets in bytes of 2-byte elements.
    const std::vector<int64_t> shape = {1, 6, 3, 5}, packed_strides = {6 * 3 * 3 * 5, 3 * 3 * 5, 5, 1};
    auto packed = pool->acquire(size_t(6 * 3 * 3 * 5) * 2);
    auto* base = static_cast<uint16_t*>(packed->data);
    TensorView pq{base, shape, packed_strides}, pk{base + 15, shape, packed_strides};
    pq.dtype = pk.dtype = DType::f16;
    FlashParams pp = make_forward_params(pq, pk, pk, {});
    std::vector<uint16_t> o2(6 * 3 * 5);
    std::vector<float> lse2(18);
    ForwardIO io2{base, base + 15, base + 30, o2.data(), lse2.data()};
    io2.dtype = DType::f16;
    auto call2 = CallBuffers<HostPool>::forward(*pool, pp, io2);
    CHECK(call2.transfers().inputs_in_place == 3 && call2.transfers().input_copies == 0);
    CHECK(call2.binding(Slot::k).offset == 30 && call2.binding(Slot::v).offset == 60);
}

void test_stage_same_array_copied_once() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    const std::vector<int64_t> shape = {1, 9, 2, 4};
    std::vector<float> x(72, 1.0f), o(72), lse(18);
    const TensorView xv = view(x.data(), shape, contiguous(shape));
    FlashParams p = make_forward_params(xv, xv, xv, {});
    auto call = CallBuffers<HostPool>::forward(*pool, p, {x.data(), x.data(), x.data(), o.data(), lse.data()});
    CHECK(call.transfers().input_copies == 1);
    CHECK(call.binding(Slot::q).handle == call.binding(Slot::v).handle);
}

void test_stage_pool_arrays_in_place() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    const int64_t B = 2, T = 6, H = 3, D = 5;
    // A packed (B, T, 3, H, D) qkv array living in a pool buffer, as fa.empty gives.
    auto packed = pool->acquire(size_t(B * T * 3 * H * D) * sizeof(float));
    auto* base = static_cast<float*>(packed->data);
    const std::vector<int64_t> shape = {B, T, H, D}, strides = {T * 3 * H * D, 3 * H * D, D, 1};
    const float *q = base, *k = base + H * D, *v = base + 2 * H * D;
    FlashParams p = make_forward_params(view(q, shape, strides), view(k, shape, strides),
                                        view(v, shape, strides), {});
    auto o = pool->acquire(size_t(B * T * H * D) * sizeof(float));
    auto lse = pool->acquire(size_t(B * H * T) * sizeof(float));
    auto call = CallBuffers<HostPool>::forward(
        *pool, p, {q, k, v, static_cast<float*>(o->data), static_cast<float*>(lse->data)});
    const TransferStats& t = call.transfers();
    CHECK(t.inputs_in_place == 3 && t.input_copies == 0 && t.input_copy_bytes == 0);
    CHECK(t.outputs_in_place == 2 && t.output_copies == 0);
    CHECK(call.binding(Slot::k).handle == packed->handle);
    CHECK(call.binding(Slot::k).offset == size_t(H * D) * sizeof(float));
    CHECK(call.binding(Slot::v).offset == size_t(2 * H * D) * sizeof(float));
    CHECK(call.binding(Slot::o).handle == o->handle && call.binding(Slot::o).offset == 0);
    CHECK(call.params().q.t == 3 * H * D);  // strides untouched: read in place
    const PoolStats before = pool->stats();
    call.finish();
    CHECK(pool->stats().allocations == before.allocations);
}

void test_stage_pool_arrays_that_must_be_copied() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    const int64_t B = 2, T = 4, H = 2, D = 8;
    auto buf = pool->acquire(size_t(B * T * H * D) * sizeof(float));
    auto* base = static_cast<float*>(buf->data);
    // Reversed time axis (negative stride): copied, made compact. (Views that
    // would run past their buffer cannot be made safely; find() covers that bound.)
    const std::vector<int64_t> shape = {B, T, H, D};
    const std::vector<int64_t> reversed = {T * H * D, -H * D, D, 1};
    const float* last_row = base + (T - 1) * H * D;
    const std::vector<int64_t> c = contiguous(shape);
    FlashParams p = make_forward_params(view(last_row, shape, reversed), view(base, shape, c),
                                        view(base, shape, c), {});
    std::vector<float> o(B * T * H * D), lse(B * H * T);
    auto call = CallBuffers<HostPool>::forward(*pool, p, {last_row, base, base, o.data(), lse.data()});
    CHECK(call.transfers().input_copies == 1 && call.transfers().inputs_in_place == 2);
    CHECK(call.params().q.t == H * D);
    CHECK(bound_data(call.binding(Slot::q).handle, 0)[0] == last_row[0]);

}

void test_stage_backward() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    const std::vector<int64_t> shape = {1, 3, 2, 4};
    std::vector<float> x(24, 1.0f), lse(6, 0.0f), dq(24), dk(24), dv(24);
    const TensorView xv = view(x.data(), shape, contiguous(shape));
    const TensorView lv = view(lse.data(), {1, 2, 3}, {6, 3, 1});
    FlashParams p = make_backward_params(xv, xv, xv, xv, xv, lv, {});
    BackwardIO io{x.data(), x.data(), x.data(), x.data(), x.data(), lse.data(),
                  dq.data(), dk.data(), dv.data()};
    auto call = CallBuffers<HostPool>::backward(*pool, p, io);
    CHECK(call.transfers().input_copies == 2);  // x once (used five times), lse once
    CHECK(call.transfers().output_copies == 3);
    for (Slot s : {Slot::dout, Slot::q, Slot::k, Slot::v, Slot::o, Slot::lse, Slot::dq, Slot::dk,
                   Slot::dv})
        CHECK(call.binding(s).bound);
    CHECK(!call.binding(Slot::delta).bound);
    call.scratch(Slot::delta, 6);
    CHECK(call.binding(Slot::delta).bound);
    CHECK(call.binding(Slot::delta).handle->size >= 6 * sizeof(float));
}

// Broadcast and overlapping views are copied as the memory they span, strides
// kept: never expanded to their logical size (test_sizes.py's k/v of 2^31
// logical elements over 134 MB). A view with gaps is copied compactly.
void test_stage_spans_not_logical_sizes() {
    auto pool = HostPool::create(HostBackend{}, kPage, 1 << 30);
    const int64_t B = 3, Tq = 50, Tk = 4000, H = 4, Hkv = 2, D = 8;
    std::vector<float> q(B * Tq * H * D, 0.5f);
    std::vector<float> kv_row(Hkv * D);  // one row, broadcast over B and Tk
    for (size_t i = 0; i < kv_row.size(); ++i) kv_row[i] = float(i);
    std::vector<float> window((Tk + 3) * D);  // overlapping: head h reads rows t + h
    for (size_t i = 0; i < window.size(); ++i) window[i] = -float(i);
    const std::vector<int64_t> kv_shape = {B, Tk, Hkv, D};
    FlashParams p = make_forward_params(view(q.data(), {B, Tq, H, D}, contiguous({B, Tq, H, D})),
                                        view(kv_row.data(), kv_shape, {0, 0, D, 1}),
                                        view(window.data(), kv_shape, {0, D, D, 1}), {});
    std::vector<float> o(q.size()), lse(B * H * Tq);
    auto call = CallBuffers<HostPool>::forward(*pool, p, {q.data(), kv_row.data(), window.data(),
                                                          o.data(), lse.data()});
    const TransferStats& t = call.transfers();
    CHECK(t.input_copies == 3 && t.inputs_no_copy == 0);
    const uint64_t spans = q.size() + Hkv * D + (Tk - 1 + Hkv) * D;
    CHECK(t.input_copy_bytes == spans * sizeof(float));  // not 2 * B * Tk * Hkv * D more
    CHECK(call.params().k.b == 0 && call.params().k.t == 0 && call.params().k.h == D);
    CHECK(call.params().v.t == D && call.params().v.h == D);
    CHECK(std::memcmp(bound_data(call.binding(Slot::k).handle, 0), kv_row.data(),
                      kv_row.size() * sizeof(float)) == 0);
    CHECK(bound_data(call.binding(Slot::v).handle, 0)[(Tk - 1 + Hkv) * D - 1] ==
          window[(Tk - 1 + Hkv) * D - 1]);
}

// With a backend that can wrap host memory, host inputs are bound in place
// over their page-rounded spans (the pointer the kernel sees is the array's),
// strides kept; pool arrays still go by the pool; negative strides are copied.
void test_stage_host_inputs_without_copies() {
    HostBackend backend;
    backend.can_wrap = true;
    auto wrapped = backend.wrapped;
    auto pool = HostPool::create(backend, kPage, 1 << 30);
    const int64_t B = 2, T = 37, H = 3, D = 5;
    const std::vector<int64_t> shape = {B, T, H, D};
    // An unaligned host array: a packed qkv with q, k, v as strided slices.
    std::vector<float> qkv(B * T * 3 * H * D + 1);
    const float* base = qkv.data() + 1;
    const std::vector<int64_t> strides = {T * 3 * H * D, 3 * H * D, D, 1};
    const float *q = base, *k = base + H * D, *v = base + 2 * H * D;
    FlashParams p = make_forward_params(view(q, shape, strides), view(k, shape, strides),
                                        view(v, shape, strides), {});
    std::vector<float> o(B * T * H * D), lse(B * H * T);
    auto call = CallBuffers<HostPool>::forward(*pool, p, {q, k, v, o.data(), lse.data()});
    const TransferStats& t = call.transfers();
    CHECK(t.inputs_no_copy == 3 && t.input_copies == 0 && t.input_copy_bytes == 0);
    CHECK(t.output_copies == 2);  // outputs are never wrapped
    for (auto [slot, src] : {std::pair{Slot::q, q}, std::pair{Slot::k, k}, std::pair{Slot::v, v}}) {
        const auto& b = call.binding(slot);
        CHECK(bound_data(b.handle, b.offset) == src);  // the array itself, not a copy
        CHECK(reinterpret_cast<uintptr_t>(b.handle->data) % kPage == 0);
        CHECK(b.handle->size % kPage == 0);
        CHECK(b.offset + size_t((B - 1) * strides[0] + (T - 1) * strides[1] + H * D) * sizeof(float) <=
              b.handle->size);
    }
    CHECK(call.params().q.t == 3 * H * D && call.params().k.b == strides[0]);
    CHECK(wrapped->size() == 3);

    // The same array for q, k and v is wrapped once.
    std::vector<float> x(B * T * H * D);
    const TensorView xv = view(x.data(), shape, contiguous(shape));
    FlashParams px = make_forward_params(xv, xv, xv, {});
    auto call2 = CallBuffers<HostPool>::forward(*pool, px, {x.data(), x.data(), x.data(), o.data(), lse.data()});
    CHECK(call2.transfers().inputs_no_copy == 1 && wrapped->size() == 4);

    // A reversed time axis cannot be bound as a span: copied compactly.
    const float* last_row = x.data() + (T - 1) * H * D;
    FlashParams pr = make_forward_params(view(last_row, shape, {T * H * D, -H * D, D, 1}), xv, xv, {});
    auto call3 = CallBuffers<HostPool>::forward(*pool, pr, {last_row, x.data(), x.data(), o.data(), lse.data()});
    CHECK(call3.transfers().input_copies == 1 && call3.transfers().inputs_no_copy == 1);
    CHECK(call3.params().q.t == H * D);
}

}  // namespace

int main() {
    test_rounding_and_fit();
    test_reuse_and_counters();
    test_best_fit();
    test_lru_eviction_and_limits();
    test_find();
    test_allocation_failure();
    test_lease_outlives_pool();
    test_threads();
    test_stage_host_inputs();
    test_stage_half_inputs();
    test_stage_same_array_copied_once();
    test_stage_pool_arrays_in_place();
    test_stage_pool_arrays_that_must_be_copied();
    test_stage_backward();
    test_stage_spans_not_logical_sizes();
    test_stage_host_inputs_without_copies();
    return flashattn_test::finish("test_metal_buffer_pool");
}
