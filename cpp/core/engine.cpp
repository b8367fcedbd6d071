// What every engine shares: default output memory, the degenerate calls (no
// rows, no keys) answered once here instead of in each engine, the refusal
// of score options an engine does not apply, and the sinks' gradient.
#include "core/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "core/half.h"
#include "core/host_memory.h"
#include "core/params.h"

namespace flashattn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

void check_supported(const char* fn, const Engine& engine, const FlashParams& p, bool backward) {
    const int missing = p.score_mods & ~engine.score_mods_supported(backward);
    if (missing == 0) return;
    std::string names;
    const std::pair<int, const char*> options[] = {
        {FA_SCORE_SOFTCAP, "softcap"},     {FA_SCORE_ALIBI, "alibi_slopes"},
        {FA_SCORE_MASK_BOOL, "mask"},      {FA_SCORE_MASK_FLOAT, "mask"},
        {FA_SCORE_SINKS, "sinks"}};
    for (const auto& [bit, name] : options)
        if ((missing & bit) && names.find(name) == std::string::npos)
            names += (names.empty() ? "" : ", ") + std::string(name);
    throw std::invalid_argument(std::string(fn) + ": the " + engine.name() +
                                " engine does not implement " + names +
                                (backward ? " in the backward" : "") + " yet; use backend='cpu'");
}

void check_dtype(const char* fn, const Engine& engine, DType dtype) {
    if (engine.dtype_supported(dtype)) return;
    throw std::invalid_argument(std::string(fn) + ": the " + engine.name() +
                                " engine does not take " + dtype_name(dtype) +
                                " inputs yet; use backend='cpu', or convert q, k and v with "
                                ".astype(np.float32)");
}

// Element i of an array of `dtype`, as float32 (exact).
float element(const void* data, int64_t i, DType dtype) {
    switch (dtype) {
        case DType::f16: return to_float(static_cast<const Half*>(data)[i]);
        case DType::bf16: return to_float(static_cast<const BFloat16*>(data)[i]);
        case DType::f32: break;
    }
    return static_cast<const float*>(data)[i];
}

}  // namespace

// dsinks[h] = -sum over b, i of exp(sink_h - lse) * (do . o): the sink's
// logit is in every row's denominator, and its value vector is zero, so
// d lse / d sink = P(sink) and d o / d sink = -P(sink) o. Summed in double.
void add_sink_gradients(const FlashParams& p, const BackwardIO& io, double* dsinks) {
    for (int64_t h = 0; h < p.H; ++h) {
        double sum = 0.0;
        const float sink = io.score.sinks[h];
        for (int64_t b = 0; b < p.B; ++b)
            for (int64_t i = 0; i < p.Tq; ++i) {
                const float lse = io.lse[(b * p.H + h) * p.Tq + i];
                if (sink == -kInf || lse == -kInf) continue;  // no sink, or a row with no weight
                const int64_t d0 = b * p.dout.b + i * p.dout.t + h * p.dout.h;
                const int64_t o0 = b * p.o.b + i * p.o.t + h * p.o.h;
                double delta = 0.0;
                for (int64_t k = 0; k < p.D; ++k)
                    delta += double(element(io.dout, d0 + k, io.dtype)) *
                             element(io.o, o0 + k, io.dtype);
                sum += std::exp(double(sink) - lse) * delta;
            }
        dsinks[h] -= sum;
    }
}

void check_engine_takes(const char* fn, const Engine& engine, const FlashParams& p, bool backward,
                        DType dtype) {
    check_supported(fn, engine, p, backward);
    check_dtype(fn, engine, dtype);
}

ForwardIO sequence_io(const Varlen& call, const ForwardIO& io, size_t i) {
    const FlashParams& s = call.seqs[i];
    ForwardIO out = io;
    out.q = element_offset(io.q, int64_t(s.seq_q0) * s.q.t, io.dtype);
    out.k = element_offset(io.k, int64_t(s.seq_k0) * s.k.t, io.dtype);
    out.v = element_offset(io.v, int64_t(s.seq_k0) * s.v.t, io.dtype);
    out.o = element_offset(io.o, int64_t(s.seq_q0) * s.o.t, io.dtype);
    out.lse = io.lse + int64_t(s.seq_q0) * s.H;
    if (io.score.alibi_slopes) out.score.alibi_slopes += int64_t(i) * io.score.params.alibi_b;
    return out;
}

BackwardIO sequence_io(const Varlen& call, const BackwardIO& io, size_t i) {
    const FlashParams& s = call.seqs[i];
    const int64_t q0 = s.seq_q0, k0 = s.seq_k0;
    BackwardIO out = io;
    out.dout = element_offset(io.dout, q0 * s.dout.t, io.dtype);
    out.q = element_offset(io.q, q0 * s.q.t, io.dtype);
    out.k = element_offset(io.k, k0 * s.k.t, io.dtype);
    out.v = element_offset(io.v, k0 * s.v.t, io.dtype);
    out.o = element_offset(io.o, q0 * s.o.t, io.dtype);
    out.lse = io.lse + q0 * s.H;
    out.dq = element_offset(io.dq, q0 * s.dq.t, io.dtype);
    out.dk = element_offset(io.dk, k0 * s.dk.t, io.dtype);
    out.dv = element_offset(io.dv, k0 * s.dv.t, io.dtype);
    if (io.score.alibi_slopes) out.score.alibi_slopes += int64_t(i) * io.score.params.alibi_b;
    out.dsinks = nullptr;
    return out;
}

std::vector<int32_t> varlen_table(const Varlen& call) {
    const size_t n = call.seqs.size();
    std::vector<int32_t> table(2 * (n + 1), 0);
    for (size_t i = 0; i < n; ++i) {
        const FlashParams& s = call.seqs[i];
        table[i] = s.seq_q0;
        table[i + 1] = s.seq_q0 + s.Tq;
        table[n + 1 + i] = s.seq_k0;
        table[n + 2 + i] = s.seq_k0 + s.Tk;
    }
    return table;
}

void Engine::forward_varlen(const Varlen& call, const ForwardIO& io) {
    for (size_t i = 0; i < call.seqs.size(); ++i)
        if (sequence_has_work(call.seqs[i])) forward(call.seqs[i], sequence_io(call, io, i));
}

void Engine::backward_varlen(const Varlen& call, const BackwardIO& io) {
    for (size_t i = 0; i < call.seqs.size(); ++i)
        if (sequence_has_work(call.seqs[i])) backward(call.seqs[i], sequence_io(call, io, i));
}

OutputBuffer Engine::allocate(size_t bytes) {
    void* data = allocate_host(bytes);
    return {data, std::shared_ptr<void>(data, std::free)};
}

void run_forward(Engine& engine, const FlashParams& p, const ForwardIO& io) {
    check_engine_takes("attention", engine, p, false, io.dtype);
    if (q_elements(p) == 0) return;
    if (p.Tk == 0) {  // every row sees no key, only its head's sink (lse = -inf without)
        std::memset(io.o, 0, size_t(q_elements(p)) * dtype_size(io.dtype));  // 0 in every dtype
        for (int64_t bh = 0; bh < int64_t(p.B) * p.H; ++bh)
            std::fill_n(io.lse + bh * p.Tq, p.Tq, io.score.sinks ? io.score.sinks[bh % p.H] : -kInf);
        return;
    }
    engine.forward(p, io);
}

void run_backward(Engine& engine, const FlashParams& p, const BackwardIO& io) {
    check_engine_takes("attention_backward", engine, p, true, io.dtype);
    if (q_elements(p) == 0 || p.Tk == 0) {  // no (query, key) pair: every gradient is zero
        const size_t size = dtype_size(io.dtype);  // all-zero bits are 0 in every dtype
        std::memset(io.dq, 0, size_t(q_elements(p)) * size);
        std::memset(io.dk, 0, size_t(kv_elements(p)) * size);
        std::memset(io.dv, 0, size_t(kv_elements(p)) * size);
    } else {
        engine.backward(p, io);
    }
    if (io.dsinks) {
        std::vector<double> sums(size_t(p.H), 0.0);
        add_sink_gradients(p, io, sums.data());
        for (int64_t h = 0; h < p.H; ++h) io.dsinks[h] = float(sums[size_t(h)]);
    }
}

}  // namespace flashattn
