// How each array of a call reaches the GPU, decided in portable C++ (so that
// it is tested on every platform). An input takes the first path that works:
//   1. pool: it lies inside a pool buffer that is handed out (an output of an
//      earlier call, fa.empty, fa.asarray): bound in place at its offset;
//   2. no copy: the host memory it spans (first to last element, rounded out
//      to whole pages) is wrapped by the backend (newBufferWithBytesNoCopy),
//      read only, for this call only: a wrap is never cached across calls,
//      since the engine does not own the host memory, which NumPy may free
//      and reuse between calls (docs/metal.md, "No-copy wraps"); its
//      strides are kept;
//   3. one copy of the memory it spans into a pooled buffer, strides kept, so
//      a broadcast or overlapping view (stride 0, k/v of 2^31 logical
//      elements over 134 MB) costs its span, never its logical size; only a
//      view with gaps, whose span exceeds its elements, or with a negative
//      stride, is copied compactly (its strides in the call's FlashParams
//      changed to match).
// The score options' arrays (core/score_arrays.h: ALiBi slopes, the mask,
// sinks) take the same three paths as views of one or four axes, bool or
// float32 elements; a compact copy keeps a broadcast axis broadcast (stride
// 0), so a mask costs the memory it spans or holds, never B·H·Tq·Tk.
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
#include "core/score_arrays.h"
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

// What a score array (core/score_arrays.h) spans and holds.
struct ScoreSpan {
    // Elements from the first to one past the last, when no axis longer
    // than 1 has a negative stride; -1 otherwise (such a view is copied compactly).
    static int64_t span(const ScoreArray& a) {
        int64_t last = 0;
        for (int d = 0; d < a.ndim; ++d) {
            if (a.shape[d] == 1) continue;
            if (a.strides[d] < 0) return -1;
            last += (a.shape[d] - 1) * a.strides[d];
        }
        return last + 1;
    }

    // The distinct elements a compact copy holds: broadcast axes (stride 0)
    // and axes of length 1 count once.
    static int64_t held(const ScoreArray& a) {
        int64_t n = 1;
        for (int d = 0; d < a.ndim; ++d)
            if (a.strides[d] != 0) n *= a.shape[d];
        return n;
    }

    // The strides of the compact copy: C order over the axes that are held,
    // 0 on the others.
    static ScoreArray compact(const ScoreArray& a) {
        ScoreArray c = a;
        int64_t step = 1;
        for (int d = a.ndim; d-- > 0;) {
            const bool kept = a.shape[d] > 1 && a.strides[d] != 0;
            c.strides[d] = kept ? step : 0;
            if (kept) step *= a.shape[d];
        }
        return c;
    }

    // Copies the held elements of `a` to dst in the layout of compact(a).
    static void copy_compact(const ScoreArray& a, void* dst) {
        const ScoreArray c = compact(a);
        int64_t n[4] = {1, 1, 1, 1}, s[4] = {0, 0, 0, 0}, t[4] = {0, 0, 0, 0};
        for (int d = 0; d < a.ndim; ++d) {  // right-aligned in four axes; broadcast ones once
            const int at = 4 - a.ndim + d;
            n[at] = c.strides[d] != 0 ? a.shape[d] : 1;
            s[at] = a.strides[d], t[at] = c.strides[d];
        }
        const auto* src = static_cast<const unsigned char*>(a.data);
        auto* out = static_cast<unsigned char*>(dst);
        const size_t e = size_t(a.element_bytes);
        for (int64_t i0 = 0; i0 < n[0]; ++i0)
            for (int64_t i1 = 0; i1 < n[1]; ++i1)
                for (int64_t i2 = 0; i2 < n[2]; ++i2) {
                    const int64_t from = i0 * s[0] + i1 * s[1] + i2 * s[2];
                    const int64_t to = i0 * t[0] + i1 * t[1] + i2 * t[2];
                    for (int64_t i3 = 0; i3 < n[3]; ++i3)
                        std::memcpy(out + size_t(to + i3 * t[3]) * e,
                                    src + (from + i3 * s[3]) * int64_t(e), e);
                }
    }
};

// The size of the buffer an executor binds to a slot the call does not use
// (CallBuffers::Binding::unused): one 16-byte-aligned block, never read.
constexpr size_t kUnusedSlotBytes = 16;

template <class Pool>
class CallBuffers {
public:
    using Handle = typename Pool::Handle;
    using LeasePtr = std::shared_ptr<typename Pool::Lease>;

    struct Binding {
        Handle handle{};
        size_t offset = 0;  // bytes
        bool bound = false;
        // A slot the launch declares but this call does not use (a score
        // option it does not have): the executor binds its own dedicated
        // buffer of kUnusedSlotBytes at offset 0 there (see buffer_for).
        bool unused = false;
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
        c.score_inputs(p, io.score);
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
        c.score_inputs(p, io.score);
        return c;
    }

    // Scratch that only the kernels read and write (Plan::scratch).
    void scratch(Slot s, int64_t n_floats) {
        LeasePtr lease = pool_->acquire(size_t(n_floats) * sizeof(float));
        bind(s, lease->handle, 0);
        leases_.push_back(std::move(lease));
    }

    // A varlen call's sequences' table (core/engine.h's varlen_table),
    // copied into a pool buffer bound to Slot::seqs. Not through input():
    // the table is the engine's own temporary vector, never pool memory nor
    // a user's array, so input()'s look-up and no-copy wrap cannot apply,
    // and it is 8 bytes a sequence.
    void sequences(const std::vector<int32_t>& table) {
        const size_t bytes = table.size() * sizeof(int32_t);
        LeasePtr lease = pool_->acquire(bytes);
        std::memcpy(lease->data, table.data(), bytes);
        bind(Slot::seqs, lease->handle, 0);
        transfers_.input_copies += 1;
        transfers_.input_copy_bytes += uint64_t(bytes);
        leases_.push_back(std::move(lease));
    }

    // The call's parameters, with the strides of copied inputs made compact.
    const FlashParams& params() const { return params_; }
    // The score options' values, with the mask's and slopes' strides as bound.
    const FlashScoreParams& score_params() const { return score_; }
    const Binding& binding(Slot s) const { return slots_[size_t(s)]; }

    // What [[buffer(index)]] of `launch` is bound to (Slot::params and
    // Slot::score go by value, not here): the slot's buffer; for a score
    // array the call does not use, a Binding marked `unused`, for which the
    // executor binds a small dedicated buffer (Metal wants a buffer at every
    // index the kernel declares; the kernels do not read it without the
    // option's score_mods bit). Not another argument at some offset: Metal's
    // API validation layer flags a binding at an odd offset. Throws
    // std::runtime_error when the call has no buffer the kernel reads.
    const Binding& buffer_for(const Launch& launch, size_t index) const {
        const Slot s = launch.buffers[index];
        const Binding& b = binding(s);
        if (b.bound) return b;
        if (is_score_slot(s) && !score_slot_used(s, params_.score_mods)) return unused_;
        throw std::runtime_error("metal: kernel '" + launch.kernel + "' binds '" + slot_name(s) +
                                 "', which this call has no buffer for");
    }
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

    void score_inputs(const FlashParams& p, const ScoreInputs& in) {
        score_ = in.params;
        for (const ScoreArray& a : score_arrays(p, in)) score_input(a);
    }

    // A score array by the three paths, bound at its element [0, ...]; a
    // compact copy's strides go to score_. Bool masks have no alignment to
    // keep; float32 arrays are bound at 4-byte offsets.
    void score_input(const ScoreArray& a) {
        if (!a.data)
            throw std::runtime_error(std::string("metal: no array for input ") + slot_name(a.slot));
        const int64_t span = ScoreSpan::span(a);
        const size_t bytes = span > 0 ? size_t(span * a.element_bytes) : 0;
        const size_t align = size_t(a.element_bytes);
        if (span > 0) {
            if (auto where = pool_->find(a.data, bytes); where && where->offset % align == 0) {
                bind(a.slot, where->handle, where->offset);
                transfers_.inputs_in_place += 1;
                return;
            }
            if (auto wrapped = pool_->wrap(a.data, bytes); wrapped && wrapped->offset % align == 0) {
                bind(a.slot, wrapped->handle, wrapped->offset);
                transfers_.inputs_no_copy += 1;
                transfers_.inputs_no_copy_bytes += bytes;
                return;
            }
        }
        const bool compact = !(span > 0 && span <= ScoreSpan::held(a));
        const int64_t n = compact ? ScoreSpan::held(a) : span;
        LeasePtr lease = pool_->acquire(size_t(n * a.element_bytes));
        if (compact) {
            ScoreSpan::copy_compact(a, lease->data);
            set_strides(score_, ScoreSpan::compact(a));
        } else {
            std::memcpy(lease->data, a.data, size_t(n * a.element_bytes));
        }
        bind(a.slot, lease->handle, 0);
        transfers_.input_copies += 1;
        transfers_.input_copy_bytes += uint64_t(n * a.element_bytes);
        leases_.push_back(std::move(lease));
    }

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
    Binding unused_{Handle{}, 0, false, true};
    FlashParams params_;
    FlashScoreParams score_{};
    std::array<Binding, kSlotCount> slots_{};
    std::vector<LeasePtr> leases_;
    std::vector<CopyBack> copy_backs_;
    std::vector<Staged> staged_;
    TransferStats transfers_;
};

// The metal host's steps for one call, in portable C++ so that tests run
// them under metal-sim (tests/cpp/test_metal_host_sim.cpp): stage the
// arrays, plan with the staged strides and the score options' values (the
// plan's function constants come from params.score_mods), bind the plan's
// scratch, execute(plan, call), then copy the outputs back. Returns what
// crossed between host and pool memory.
template <class Pool, class Execute>
TransferStats run_staged(CallBuffers<Pool> call, Plan plan, Execute&& execute) {
    plan.score = call.score_params();
    for (const Scratch& s : plan.scratch)
        if (s.floats > 0) call.scratch(s.slot, s.floats);
    execute(static_cast<const Plan&>(plan), static_cast<const CallBuffers<Pool>&>(call));
    call.finish();
    return call.transfers();
}

template <class Pool, class Execute>
TransferStats run_staged_forward(Pool& pool, const FlashParams& p, const ForwardIO& io,
                                 const GpuInfo& gpu, Execute&& execute) {
    CallBuffers<Pool> call = CallBuffers<Pool>::forward(pool, p, io);
    Plan plan = plan_forward(call.params(), io.dtype, gpu);
    return run_staged(std::move(call), std::move(plan), execute);
}

template <class Pool, class Execute>
TransferStats run_staged_backward(Pool& pool, const FlashParams& p, const BackwardIO& io,
                                  Execute&& execute) {
    CallBuffers<Pool> call = CallBuffers<Pool>::backward(pool, p, io);
    Plan plan = plan_backward(call.params(), io.dtype);
    return run_staged(std::move(call), std::move(plan), execute);
}

// A variable-length batch (core/engine.h's Varlen) in one plan (issue 34):
// the packed arrays are staged as one call of B = 1 and T = total rows (the
// layout they have), the sequences' table is bound to Slot::seqs, and the
// plan is the packed call's (varlen_seqs > 0: grid.z = the sequences).
inline FlashParams varlen_staging_view(const Varlen& v, const std::vector<int32_t>& table) {
    const size_t n = v.seqs.size();
    FlashParams view = v.packed;
    view.B = 1;
    view.Tq = table[n];
    view.Tk = table[2 * n + 1];
    view.varlen_seqs = 0;
    return view;
}
inline FlashParams varlen_plan_params(const Varlen& v, const FlashParams& staged) {
    FlashParams p = v.packed;
    p.q = staged.q, p.k = staged.k, p.v = staged.v, p.o = staged.o, p.dout = staged.dout;
    p.dq = staged.dq, p.dk = staged.dk, p.dv = staged.dv;
    return p;
}

template <class Pool, class Execute>
TransferStats run_staged_forward_varlen(Pool& pool, const Varlen& v, const ForwardIO& io,
                                        const GpuInfo& gpu, Execute&& execute) {
    const std::vector<int32_t> table = varlen_table(v);
    CallBuffers<Pool> call = CallBuffers<Pool>::forward(pool, varlen_staging_view(v, table), io);
    call.sequences(table);
    Plan plan = plan_forward(varlen_plan_params(v, call.params()), io.dtype, gpu);
    return run_staged(std::move(call), std::move(plan), execute);
}

template <class Pool, class Execute>
TransferStats run_staged_backward_varlen(Pool& pool, const Varlen& v, const BackwardIO& io,
                                         Execute&& execute) {
    const std::vector<int32_t> table = varlen_table(v);
    CallBuffers<Pool> call = CallBuffers<Pool>::backward(pool, varlen_staging_view(v, table), io);
    call.sequences(table);
    Plan plan = plan_backward(varlen_plan_params(v, call.params()), io.dtype);
    return run_staged(std::move(call), std::move(plan), execute);
}

}  // namespace flashattn::metal
