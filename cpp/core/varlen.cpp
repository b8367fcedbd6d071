// Variable-length batches as a loop of ordinary calls, one per sequence (see
// varlen.h): the engines need nothing of their own for them.
#include "core/varlen.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace flashattn {
namespace {

[[noreturn]] void fail(const char* fn, const std::string& what) {
    throw std::invalid_argument(std::string(fn) + ": " + what);
}

void check_3d(const char* fn, const char* name, const char* axes, const TensorView& t) {
    if (t.ndim() != 3)
        fail(fn, std::string(name) + " must have 3 dimensions " + axes + ", got shape " +
                     shape_string(t.shape));
}

// Rows [r0, r1) of a (total, heads, D) array as a (1, r1 - r0, heads, D) call array.
TensorView rows_of(const TensorView& t, int64_t r0, int64_t r1) {
    TensorView s;
    s.data = t.at(r0 * t.strides[0]);
    s.dtype = t.dtype;
    s.shape = {1, r1 - r0, t.shape[1], t.shape[2]};
    s.strides = {(r1 - r0) * t.strides[0], t.strides[0], t.strides[1], t.strides[2]};
    return s;
}

// The options of sequence b: its row of the (batch, H) slopes.
ScoreOptions options_of_sequence(const ScoreOptions& score, int64_t b) {
    ScoreOptions s = score;
    if (s.alibi_slopes) {
        TensorView& a = *s.alibi_slopes;
        a.data = a.at(b * a.strides[0]);
        a.shape = {1, a.shape[1]};
    }
    return s;
}

// The checks of a plain call on the whole arrays (heads, head size, window,
// scale), as function fn reports them.
void check_whole(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionOptions& options) {
    check_3d(fn, "q", "(total_q, H, D)", q);
    check_3d(fn, "k", "(total_k, Hkv, D)", k);
    check_3d(fn, "v", "(total_k, Hkv, D)", v);
    auto as_4d = [](const TensorView& t) {
        return std::vector<int64_t>{1, t.shape[0], t.shape[1], t.shape[2]};
    };
    check_call_shapes(fn, as_4d(q), as_4d(k), as_4d(v), options);
}

}  // namespace

Sequences make_sequences(const char* fn, const int32_t* cu_q, int64_t n_q, const int32_t* cu_k,
                         int64_t n_k, int64_t total_q, int64_t total_k) {
    if (n_q != n_k)
        fail(fn, "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got " +
                     std::to_string(n_q) + " and " + std::to_string(n_k));
    Sequences s;
    const struct {
        const char* name;
        const int32_t* cu;
        int64_t total;
        std::vector<int64_t>& out;
    } sides[] = {{"cu_seqlens_q", cu_q, total_q, s.cu_q}, {"cu_seqlens_k", cu_k, total_k, s.cu_k}};
    for (const auto& side : sides) {
        if (n_q < 1) fail(fn, std::string(side.name) + " must have at least one entry");
        const std::string name = side.name;
        if (side.cu[0] != 0)
            fail(fn, name + "[0] must be 0, got " + std::to_string(side.cu[0]));
        for (int64_t b = 1; b < n_q; ++b)
            if (side.cu[b] < side.cu[b - 1])
                fail(fn, name + " must be non-decreasing; " + name + "[" + std::to_string(b) +
                             "] = " + std::to_string(side.cu[b]) + " < " + name + "[" +
                             std::to_string(b - 1) + "] = " + std::to_string(side.cu[b - 1]));
        if (side.cu[n_q - 1] != side.total)
            fail(fn, name + "[" + std::to_string(n_q - 1) + "] = " +
                         std::to_string(side.cu[n_q - 1]) + " must equal the number of rows " +
                         std::to_string(side.total));
        side.out.assign(side.cu, side.cu + n_q);
    }
    return s;
}

void run_forward_varlen(Engine& engine, const Sequences& seqs, const TensorView& q,
                        const TensorView& k, const TensorView& v, const AttentionOptions& options,
                        const ScoreOptions& score, void* o, float* lse) {
    const char* fn = "attention_varlen";
    check_whole(fn, q, k, v, options);
    const int64_t total_q = q.shape[0], H = q.shape[1], D = q.shape[2];
    std::vector<float> lse_b;
    for (int64_t b = 0; b < seqs.batch(); ++b) {
        const int64_t q0 = seqs.cu_q[b], q1 = seqs.cu_q[b + 1];
        const int64_t k0 = seqs.cu_k[b], k1 = seqs.cu_k[b + 1];
        if (q1 == q0) continue;
        FlashParams p = make_forward_params(rows_of(q, q0, q1), rows_of(k, k0, k1),
                                            rows_of(v, k0, k1), options);
        ForwardIO io{q.at(q0 * q.strides[0]), k.at(k0 * k.strides[0]), v.at(k0 * v.strides[0]),
                     element_offset(o, q0 * H * D, q.dtype), nullptr};
        io.dtype = q.dtype;
        io.score = make_score_inputs(fn, p, options_of_sequence(score, b));
        lse_b.resize(size_t(H * (q1 - q0)));
        io.lse = lse_b.data();
        run_forward(engine, p, io);
        for (int64_t h = 0; h < H; ++h)  // (1, H, Tq_b) into (H, total_q)
            std::copy_n(lse_b.data() + h * (q1 - q0), q1 - q0, lse + h * total_q + q0);
    }
}

void run_backward_varlen(Engine& engine, const Sequences& seqs, const TensorView& dout,
                         const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const float* lse, const AttentionOptions& options,
                         const ScoreOptions& score, void* dq, void* dk, void* dv,
                         float* dsinks) {
    const char* fn = "attention_varlen_backward";
    check_whole(fn, q, k, v, options);
    check_3d(fn, "do", "(total_q, H, D)", dout);
    check_3d(fn, "o", "(total_q, H, D)", o);
    if (dout.shape != q.shape || o.shape != q.shape)
        fail(fn, "do and o must have the shape of q " + shape_string(q.shape) + ", got " +
                     shape_string(dout.shape) + " and " + shape_string(o.shape));
    const int64_t total_q = q.shape[0], H = q.shape[1], D = q.shape[2];
    const int64_t Hkv = k.shape[1];
    // Keys of sequences without queries: zero bits are 0 in every dtype.
    std::memset(dk, 0, size_t(k.shape[0] * Hkv * D) * dtype_size(q.dtype));
    std::memset(dv, 0, size_t(k.shape[0] * Hkv * D) * dtype_size(q.dtype));
    if (dsinks) std::fill_n(dsinks, H, 0.0f);
    // Every row of dq belongs to a sequence with queries, whose call writes it.
    std::vector<float> lse_b, dsinks_b(static_cast<size_t>(H));
    for (int64_t b = 0; b < seqs.batch(); ++b) {
        const int64_t q0 = seqs.cu_q[b], q1 = seqs.cu_q[b + 1], n = q1 - q0;
        const int64_t k0 = seqs.cu_k[b], k1 = seqs.cu_k[b + 1];
        if (n == 0) continue;
        lse_b.resize(size_t(H * n));
        for (int64_t h = 0; h < H; ++h)  // (H, total_q) into (1, H, Tq_b)
            std::copy_n(lse + h * total_q + q0, n, lse_b.data() + h * n);
        TensorView lse_view;
        lse_view.data = lse_b.data();
        lse_view.shape = {1, H, n};
        lse_view.strides = {H * n, n, 1};
        FlashParams p = make_backward_params(rows_of(dout, q0, q1), rows_of(q, q0, q1),
                                             rows_of(k, k0, k1), rows_of(v, k0, k1),
                                             rows_of(o, q0, q1), lse_view, options);
        const DType dt = q.dtype;
        BackwardIO io{dout.at(q0 * dout.strides[0]),
                      q.at(q0 * q.strides[0]),
                      k.at(k0 * k.strides[0]),
                      v.at(k0 * v.strides[0]),
                      o.at(q0 * o.strides[0]),
                      lse_b.data(),
                      element_offset(dq, q0 * H * D, dt),
                      element_offset(dk, k0 * Hkv * D, dt),
                      element_offset(dv, k0 * Hkv * D, dt)};
        io.dtype = dt;
        io.score = make_score_inputs(fn, p, options_of_sequence(score, b));
        io.dsinks = dsinks ? dsinks_b.data() : nullptr;
        run_backward(engine, p, io);
        if (dsinks)
            for (int64_t h = 0; h < H; ++h) dsinks[h] += dsinks_b[size_t(h)];
    }
}

}  // namespace flashattn
