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

// The shape of a (B, T, heads, D) tensor as the kernels see it.
struct Tensor4 {
    int64_t B, T, heads, D;
    FlashStrides strides;

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

    void copy_compact(const float* src, float* dst) const {
        for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t h = 0; h < heads; ++h)
                    std::memcpy(dst + ((b * T + t) * heads + h) * D,
                                src + b * strides.b + t * strides.t + h * strides.h,
                                size_t(D) * sizeof(float));
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

    // The call's arrays as float32: the metal engine takes no other dtype
    // yet (Engine::dtype_supported; run_forward refuses the others).
    static const float* f32(const void* p) { return static_cast<const float*>(p); }
    static float* f32(void* p) { return static_cast<float*>(p); }

    static CallBuffers forward(Pool& pool, const FlashParams& p, const ForwardIO& io) {
        CallBuffers c(pool, p);
        c.input(Slot::q, f32(io.q), {p.B, p.Tq, p.H, p.D, p.q}, &c.params_.q);
        c.input(Slot::k, f32(io.k), {p.B, p.Tk, p.Hkv, p.D, p.k}, &c.params_.k);
        c.input(Slot::v, f32(io.v), {p.B, p.Tk, p.Hkv, p.D, p.v}, &c.params_.v);
        c.output(Slot::o, f32(io.o), int64_t(p.B) * p.Tq * p.H * p.D);
        c.output(Slot::lse, io.lse, lse_elements(p));
        return c;
    }

    static CallBuffers backward(Pool& pool, const FlashParams& p, const BackwardIO& io) {
        CallBuffers c(pool, p);
        c.input(Slot::dout, f32(io.dout), {p.B, p.Tq, p.H, p.D, p.dout}, &c.params_.dout);
        c.input(Slot::q, f32(io.q), {p.B, p.Tq, p.H, p.D, p.q}, &c.params_.q);
        c.input(Slot::k, f32(io.k), {p.B, p.Tk, p.Hkv, p.D, p.k}, &c.params_.k);
        c.input(Slot::v, f32(io.v), {p.B, p.Tk, p.Hkv, p.D, p.v}, &c.params_.v);
        c.input(Slot::o, f32(io.o), {p.B, p.Tq, p.H, p.D, p.o}, &c.params_.o);
        // lse is (B, H, Tq) C-contiguous (checked by make_backward_params).
        c.input(Slot::lse, io.lse, {1, 1, 1, lse_elements(p), {0, 0, 0}}, nullptr);
        c.output(Slot::dq, f32(io.dq), int64_t(p.B) * p.Tq * p.H * p.D);
        c.output(Slot::dk, f32(io.dk), int64_t(p.B) * p.Tk * p.Hkv * p.D);
        c.output(Slot::dv, f32(io.dv), int64_t(p.B) * p.Tk * p.Hkv * p.D);
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
        for (const CopyBack& c : copy_backs_)
            std::memcpy(c.to, c.from, size_t(c.n) * sizeof(float));
        copy_backs_.clear();
    }

private:
    struct CopyBack {
        const float* from;
        float* to;
        int64_t n;
    };
    struct Staged {  // an input already wrapped or copied in this call (e.g. q, k, v one array)
        const float* src;
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
    void input(Slot s, const float* src, const Tensor4& t, FlashStrides* strides) {
        if (!src) throw std::runtime_error(std::string("metal: no array for input ") + slot_name(s));
        const int64_t span = t.span();
        const size_t bytes = span > 0 ? size_t(span) * sizeof(float) : 0;
        if (span > 0) {
            if (auto where = pool_->find(src, bytes); where && where->offset % alignof(float) == 0) {
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
        LeasePtr lease = pool_->acquire(size_t(n) * sizeof(float));
        if (compact) {
            t.copy_compact(src, static_cast<float*>(lease->data));
            if (strides) *strides = t.contiguous();
        } else {
            std::memcpy(lease->data, src, size_t(n) * sizeof(float));
        }
        bind(s, lease->handle, 0);
        remember(src, t, s, compact);
        transfers_.input_copies += 1;
        transfers_.input_copy_bytes += uint64_t(n) * sizeof(float);
        leases_.push_back(std::move(lease));
    }

    void remember(const float* src, const Tensor4& t, Slot s, bool compact) {
        staged_.push_back(Staged{src, t, slots_[size_t(s)], compact});
    }

    void output(Slot s, float* dst, int64_t n) {
        if (!dst) throw std::runtime_error(std::string("metal: no array for output ") + slot_name(s));
        if (auto where = pool_->find(dst, size_t(n) * sizeof(float));
            where && where->offset % alignof(float) == 0) {
            bind(s, where->handle, where->offset);
            transfers_.outputs_in_place += 1;
            return;
        }
        LeasePtr lease = pool_->acquire(size_t(n) * sizeof(float));
        bind(s, lease->handle, 0);
        copy_backs_.push_back(CopyBack{static_cast<const float*>(lease->data), dst, n});
        transfers_.output_copies += 1;
        transfers_.output_copy_bytes += uint64_t(n) * sizeof(float);
        leases_.push_back(std::move(lease));
    }

    static bool same_view(const Tensor4& a, const Tensor4& b) {
        return a.B == b.B && a.T == b.T && a.heads == b.heads && a.D == b.D &&
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
