// Variable-length batches (see varlen.h): the sequences checked and made
// ordinary calls of B = 1 (core Varlen), the outputs of sequences without
// keys written here, and lse moved between the engines' per-sequence layout
// and the (H, total_q) one of the API.
#include "core/varlen.h"

#include <algorithm>
#include <cstring>
#include <limits>
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

Varlen make_varlen(const char* fn, const Sequences& seqs, const TensorView& q,
                   const TensorView& k, const TensorView& v, const AttentionOptions& options,
                   const ScoreOptions& score, ScoreInputs& packed_score) {
    auto as_4d = [](const TensorView& t) {
        TensorView w = t;
        w.shape = {1, t.shape[0], t.shape[1], t.shape[2]};
        w.strides = {t.shape[0] * t.strides[0], t.strides[0], t.strides[1], t.strides[2]};
        return w;
    };
    Varlen call;
    call.packed = make_forward_params(as_4d(q), as_4d(k), as_4d(v), options);
    FlashParams& packed = call.packed;
    packed.B = fa_int(seqs.batch());
    packed.Tq = packed.Tk = 0;
    for (int64_t b = 0; b < seqs.batch(); ++b) {
        const int64_t q0 = seqs.cu_q[b], q1 = seqs.cu_q[b + 1];
        const int64_t k0 = seqs.cu_k[b], k1 = seqs.cu_k[b + 1];
        FlashParams p = make_forward_params(rows_of(q, q0, q1), rows_of(k, k0, k1),
                                            rows_of(v, k0, k1), options);
        (void)make_score_inputs(fn, p, options_of_sequence(score, b));  // checks; sets score_mods
        p.seq_q0 = fa_int(q0);
        p.seq_k0 = fa_int(k0);
        p.seq_index = fa_int(b);
        packed.Tq = std::max(packed.Tq, p.Tq);
        packed.Tk = std::max(packed.Tk, p.Tk);
        call.seqs.push_back(p);
    }
    packed.varlen_seqs = packed.B;
    packed_score = make_score_inputs(fn, packed, score);
    return call;
}

namespace {

// The per-sequence lse layout (sequence b's (H, Tq_b) at H * q0) to and
// from the API's (H, total_q).
void lse_to_api(const Varlen& call, const float* seq_lse, float* lse, int64_t total_q) {
    for (const FlashParams& s : call.seqs)
        for (int64_t h = 0; h < s.H; ++h)
            std::copy_n(seq_lse + int64_t(s.seq_q0) * s.H + h * s.Tq, s.Tq,
                        lse + h * total_q + s.seq_q0);
}
void lse_from_api(const Varlen& call, const float* lse, float* seq_lse, int64_t total_q) {
    for (const FlashParams& s : call.seqs)
        for (int64_t h = 0; h < s.H; ++h)
            std::copy_n(lse + h * total_q + s.seq_q0, s.Tq,
                        seq_lse + int64_t(s.seq_q0) * s.H + h * s.Tq);
}

}  // namespace

void run_forward_varlen(Engine& engine, const Sequences& seqs, const TensorView& q,
                        const TensorView& k, const TensorView& v, const AttentionOptions& options,
                        const ScoreOptions& score, void* o, float* lse, VarlenSchedule schedule) {
    const char* fn = "attention_varlen";
    check_whole(fn, q, k, v, options);
    const int64_t total_q = q.shape[0], H = q.shape[1], D = q.shape[2];
    ForwardIO io{q.data, k.data, v.data, o, nullptr};
    io.dtype = q.dtype;
    const Varlen call = make_varlen(fn, seqs, q, k, v, options, score, io.score);
    check_engine_takes(fn, engine, call.packed, false, io.dtype);
    if (total_q == 0) return;
    std::vector<float> seq_lse(size_t(H * total_q));
    io.lse = seq_lse.data();
    // Sequences with queries but no keys: o = 0, lse = the head's sink or -inf.
    for (size_t b = 0; b < call.seqs.size(); ++b) {
        const FlashParams& s = call.seqs[b];
        if (s.Tq == 0 || s.Tk > 0) continue;
        std::memset(element_offset(o, int64_t(s.seq_q0) * H * D, q.dtype), 0,
                    size_t(s.Tq * H * D) * dtype_size(q.dtype));
        for (int64_t h = 0; h < H; ++h)
            std::fill_n(io.lse + int64_t(s.seq_q0) * H + h * s.Tq, s.Tq,
                        io.score.sinks ? io.score.sinks[h] : -std::numeric_limits<float>::infinity());
    }
    if (schedule == VarlenSchedule::one_call)
        engine.forward_varlen(call, io);
    else
        engine.Engine::forward_varlen(call, io);
    lse_to_api(call, seq_lse.data(), lse, total_q);
}

void run_backward_varlen(Engine& engine, const Sequences& seqs, const TensorView& dout,
                         const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const float* lse, const AttentionOptions& options,
                         const ScoreOptions& score, void* dq, void* dk, void* dv,
                         float* dsinks, VarlenSchedule schedule) {
    const char* fn = "attention_varlen_backward";
    check_whole(fn, q, k, v, options);
    check_3d(fn, "do", "(total_q, H, D)", dout);
    check_3d(fn, "o", "(total_q, H, D)", o);
    if (dout.shape != q.shape || o.shape != q.shape)
        fail(fn, "do and o must have the shape of q " + shape_string(q.shape) + ", got " +
                     shape_string(dout.shape) + " and " + shape_string(o.shape));
    const int64_t total_q = q.shape[0], H = q.shape[1], D = q.shape[2];
    const int64_t Hkv = k.shape[1];
    BackwardIO io{dout.data, q.data, k.data, v.data, o.data, nullptr, dq, dk, dv};
    io.dtype = q.dtype;
    Varlen call = make_varlen(fn, seqs, q, k, v, options, score, io.score);
    check_engine_takes(fn, engine, call.packed, true, io.dtype);
    // do's and o's strides (the checks above made them the shape of q).
    call.packed.dout = {0, dout.strides[0], dout.strides[1]};
    call.packed.o = {0, o.strides[0], o.strides[1]};
    for (FlashParams& s : call.seqs) {
        s.dout = {s.Tq * dout.strides[0], dout.strides[0], dout.strides[1]};
        s.o = {s.Tq * o.strides[0], o.strides[0], o.strides[1]};
    }
    // The rows no engine call writes are zeroed here (zero bits are 0 in
    // every dtype): dk and dv of sequences without queries, dq of sequences
    // without keys. Every other row belongs to a sequence whose call writes
    // all of its rows, as a dense call does (keys no query sees get 0): a
    // memset of the whole of dk and dv first would write them all twice.
    const size_t size = dtype_size(q.dtype);
    for (const FlashParams& s : call.seqs) {
        if (s.Tq == 0 && s.Tk > 0)
            for (void* g : {dk, dv})
                std::memset(element_offset(g, int64_t(s.seq_k0) * Hkv * D, q.dtype), 0,
                            size_t(s.Tk * Hkv * D) * size);
        if (s.Tq > 0 && s.Tk == 0)
            std::memset(element_offset(dq, int64_t(s.seq_q0) * H * D, q.dtype), 0,
                        size_t(s.Tq * H * D) * size);
    }
    std::vector<float> seq_lse(size_t(H * total_q));
    lse_from_api(call, lse, seq_lse.data(), total_q);
    io.lse = seq_lse.data();
    if (total_q > 0 && k.shape[0] > 0) {
        if (schedule == VarlenSchedule::one_call)
            engine.backward_varlen(call, io);
        else
            engine.Engine::backward_varlen(call, io);
    }
    if (dsinks) {
        std::vector<double> sums(size_t(H), 0.0);
        for (size_t b = 0; b < call.seqs.size(); ++b)
            if (call.seqs[b].Tq > 0) add_sink_gradients(call.seqs[b], sequence_io(call, io, b), sums.data());
        for (int64_t h = 0; h < H; ++h) dsinks[h] = float(sums[size_t(h)]);
    }
}

}  // namespace flashattn
