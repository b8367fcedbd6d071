// How each array of a call reaches the GPU, decided in portable C++ (so that
// it is tested on every platform). An input takes the first path that works:
//   1. pool: it lies inside a pool buffer that is handed out (an output of an
//      earlier call, fa.empty, fa.asarray): bound in place at its offset;
//   2. no copy: the host memory it spans (first to last element, rounded out
//      to whole pages) is wrapped by the backend (newBufferWithBytesNoCopy),
//      read only, for the call; its strides are kept;
//   3. one copy of the memory it spans into a pooled buffer, strides kept, so
//      a broadcast or overlapping view (stride 0, k/v of 2^31 logical
//      elements over 134 MB) costs its span, never its logical size; only a
//      view with gaps, whose span exceeds its elements, or with a negative
//      stride, is copied compactly (its strides in the call's FlashParams
//      changed to match).
// An output outside the pool is computed into a pooled buffer and copied back
// after the GPU has finished. Only arrays the caller passed are ever copied,
// each at most once per call: nothing of size T².
#pragma once
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/engine.h"
#include "core/params.h"
#include "core/plan.h"
#include "flash_params.h"

namespace flashattn::metal {

// What crossed between host memory and pool buffers, summed over calls.
// Per path: inputs_in_place (pool; each use counted), inputs_no_copy
// (wrapped host memory) and input_copies (each distinct array once per call).
struct TransferStats {
    uint64_t inputs_in_place = 0;
    uint64_t inputs_no_copy = 0;
    uint64_t inputs_no_copy_bytes = 0;  // the spans wrapped (not copied)
    uint64_t input_copies = 0;
    uint64_t input_copy_bytes = 0;
    uint64_t outputs_in_place = 0;
    uint64_t output_copies = 0;
    uint64_t output_copy_bytes = 0;

    void add(const TransferStats& o) {
        inputs_in_place += o.inputs_in_place;
        inputs_no_copy += o.inputs_no_copy;
        inputs_no_copy_bytes += o.inputs_no_copy_bytes;
        input_copies += o.input_copies;
        input_copy_bytes += o.input_copy_bytes;
        outputs_in_place += o.outputs_in_place;
        output_copies += o.output_copies;
        output_copy_bytes += o.output_copy_bytes;
    }
};

// The shape of a (B, T, heads, D) tensor as the kernels see it, and its
// element size in bytes (the call's dtype; lse is float32 always).
struct Tensor4 {
    int64_t B, T, heads, D;
    FlashStrides strides;
    size_t elem = sizeof(float);

    int64_t elements() const { return B * T * heads * D; }
    FlashStrides contiguous() const { return {T * heads * D, heads * D, D}; }

    // Elements from the first to one past the last, when no used axis has a
    // negative stride; -1 otherwise (such a view is copied compactly).
    int64_t span() const {
        const int64_t n[3] = {B, T, heads};
        const int64_t s[3] = {strides.b, strides.t, strides.h};
        int64_t last = D - 1;
        for (int a = 0; a < 3; ++a) {
            if (n[a] == 1) continue;
            if (s[a] < 0) return -1;
            last += (n[a] - 1) * s[a];
        }
        return last + 1;
    }

    // Its span, when copying that (strides kept) is no bigger than a compact copy.
    bool copy_span() const {
        const int64_t s = span();
        return s > 0 && s <= elements();
    }

    void copy_compact(const void* src, void* dst) const {
        const char* from = static_cast<const char*>(src);
        char* to = static_cast<char*>(dst);
        for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t h = 0; h < heads; ++h)
                    std::memcpy(to + size_t((b * T + t) * heads + h) * size_t(D) * elem,
                                from + size_t(b * strides.b + t * strides.t + h * strides.h) * elem,
                                size_t(D) * elem);
    }
};

template <class Pool>
class CallBuffers {
public:
    using Handle = typename Pool::Handle;
    using LeasePtr = std::shared_ptr<typename Pool::Lease>;

    struct Binding {
        Handle handle{};
        size_t offset = 0;  // bytes
        bool bound = false;
    };

    // q, k, v, o, do and the gradients are of the call's dtype (es bytes
    // each); lse is float32.
    static CallBuffers forward(Pool& pool, const FlashParams& p, const ForwardIO& io) {
        CallBuffers c(pool, p);
        const size_t es = dtype_size(io.dtype);
        c.input(Slot::q, io.q, {p.B, p.Tq, p.H, p.D, p.q, es}, &c.params_.q);
        c.input(Slot::k, io.k, {p.B, p.Tk, p.Hkv, p.D, p.k, es}, &c.params_.k);
        c.input(Slot::v, io.v, {p.B, p.Tk, p.Hkv, p.D, p.v, es}, &c.params_.v);
        c.output(Slot::o, io.o, int64_t(p.B) * p.Tq * p.H * p.D, es);
        c.output(Slot::lse, io.lse, lse_elements(p), sizeof(float));
        return c;
    }

    static CallBuffers backward(Pool& pool, const FlashParams& p, const BackwardIO& io) {
        CallBuffers c(pool, p);
        const size_t es = dtype_size(io.dtype);
        c.input(Slot::dout, io.dout, {p.B, p.Tq, p.H, p.D, p.dout, es}, &c.params_.dout);
        c.input(Slot::q, io.q, {p.B, p.Tq, p.H, p.D, p.q, es}, &c.params_.q);
        c.input(Slot::k, io.k, {p.B, p.Tk, p.Hkv, p.D, p.k, es}, &c.params_.k);
        c.input(Slot::v, io.v, {p.B, p.Tk, p.Hkv, p.D, p.v, es}, &c.params_.v);
        c.input(Slot::o, io.o, {p.B, p.Tq, p.H, p.D, p.o, es}, &c.params_.o);
        // lse is (B, H, Tq) C-contiguous (checked by make_backward_params).
        c.input(Slot::lse, io.lse, {1, 1, 1, lse_elements(p), {0, 0, 0}, sizeof(float)}, nullptr);
        c.output(Slot::dq, io.dq, int64_t(p.B) * p.Tq * p.H * p.D, es);
        c.output(Slot::dk, io.dk, int64_t(p.B) * p.Tk * p.Hkv * p.D, es);
        c.output(Slot::dv, io.dv, int64_t(p.B) * p.Tk * p.Hkv * p.D, es);
        return c;
    }

    // Scratch that only the kernels read and write (Plan::scratch).
    void scratch(Slot s, int64_t n_floats) {
        LeasePtr lease = pool_->acquire(size_t(n_floats) * sizeof(float));
        bind(s, lease->handle, 0);
        leases_.push_back(std::move(lease));
    }

    // The call's parameters, with the strides of copied inputs made compact.
    const FlashParams& params() const { return params_; }
    const Binding& binding(Slot s) const { return slots_[size_t(s)]; }
    const TransferStats& transfers() const { return transfers_; }

    // After the GPU has finished: outputs computed outside their arrays are
    // copied to them. The pooled buffers return to the pool when this object dies.
    void finish() {
        for (const CopyBack& c : copy_backs_) std::memcpy(c.to, c.from, c.bytes);
        copy_backs_.clear();
    }

private:
    struct CopyBack {
        const void* from;
        void* to;
        size_t bytes;
    };
    struct Staged {  // an input already wrapped or copied in this call (e.g. q, k, v one array)
        const void* src;
        Tensor4 shape;
        Binding binding;
        bool compact;  // copied compactly: its strides changed
    };

    CallBuffers(Pool& pool, const FlashParams& p) : pool_(&pool), params_(p) {}

    void bind(Slot s, const Handle& handle, size_t offset) {
        slots_[size_t(s)] = Binding{handle, offset, true};
    }

    // `strides` (in params_) is replaced by compact strides when the input is
    // copied compactly; the other paths keep them.
    void input(Slot s, const void* src, const Tensor4& t, FlashStrides* strides) {
        if (!src) throw std::runtime_error(std::string("metal: no array for input ") + slot_name(s));
        const int64_t span = t.span();
        const size_t bytes = span > 0 ? size_t(span) * t.elem : 0;
        if (span > 0) {
            if (auto where = pool_->find(src, bytes); where && where->offset % t.elem == 0) {
                bind(s, where->handle, where->offset);
                transfers_.inputs_in_place += 1;
                return;
            }
        }
        for (const Staged& st : staged_)  // q, k, v may all be one array: wrapped or copied once
            if (st.src == src && same_view(st.shape, t)) {
                slots_[size_t(s)] = st.binding;
                if (st.compact && strides) *strides = t.contiguous();
                return;
            }
        if (span > 0) {
            if (auto wrapped = pool_->wrap(src, bytes)) {
                bind(s, wrapped->handle, wrapped->offset);
                remember(src, t, s, false);
                transfers_.inputs_no_copy += 1;
                transfers_.inputs_no_copy_bytes += bytes;
                return;
            }
        }
        const bool compact = !t.copy_span();
        const int64_t n = compact ? t.elements() : span;
        LeasePtr lease = pool_->acquire(size_t(n) * t.elem);
        if (compact) {
            t.copy_compact(src, lease->data);
            if (strides) *strides = t.contiguous();
        } else {
            std::memcpy(lease->data, src, size_t(n) * t.elem);
        }
        bind(s, lease->handle, 0);
        remember(src, t, s, compact);
        transfers_.input_copies += 1;
        transfers_.input_copy_bytes += uint64_t(n) * t.elem;
        leases_.push_back(std::move(lease));
    }

    void remember(const void* src, const Tensor4& t, Slot s, bool compact) {
        staged_.push_back(Staged{src, t, slots_[size_t(s)], compact});
    }

    void output(Slot s, void* dst, int64_t n, size_t elem) {
        if (!dst) throw std::runtime_error(std::string("metal: no array for output ") + slot_name(s));
        const size_t bytes = size_t(n) * elem;
        if (auto where = pool_->find(dst, bytes); where && where->offset % elem == 0) {
            bind(s, where->handle, where->offset);
            transfers_.outputs_in_place += 1;
            return;
        }
        LeasePtr lease = pool_->acquire(bytes);
        bind(s, lease->handle, 0);
        copy_backs_.push_back(CopyBack{lease->data, dst, bytes});
        transfers_.output_copies += 1;
        transfers_.output_copy_bytes += uint64_t(bytes);
        leases_.push_back(std::move(lease));
    }

    static bool same_view(const Tensor4& a, const Tensor4& b) {
        return a.B == b.B && a.T == b.T && a.heads == b.heads && a.D == b.D && a.elem == b.elem &&
               a.strides.b == b.strides.b && a.strides.t == b.strides.t &&
               a.strides.h == b.strides.h;
    }

    Pool* pool_;
    FlashParams params_;
    std::array<Binding, kSlotCount> slots_{};
    std::vector<LeasePtr> leases_;
    std::vector<CopyBack> copy_backs_;
    std::vector<Staged> staged_;
    TransferStats transfers_;
};

}  // namespace flashattn::metal
