// Validation and normalisation of a call's arrays and options, in one place:
// every engine receives a FlashParams that is already known to be consistent.
#include "core/params.h"

#include <cmath>
#include <limits>
#include <stdexcept>

namespace flashattn {
namespace {

[[noreturn]] void fail(const char* fn, const std::string& what) {
    throw std::invalid_argument(std::string(fn) + ": " + what);
}

void check_4d(const char* fn, const char* name, const char* axes, const TensorView& t) {
    if (t.ndim() != 4 || t.strides.size() != 4)
        fail(fn, std::string(name) + " must have 4 dimensions " + axes + ", got shape " +
                     shape_string(t.shape));
    const bool empty = t.shape[0] == 0 || t.shape[1] == 0 || t.shape[2] == 0 || t.shape[3] == 0;
    if (!empty && t.shape[3] > 1 && t.strides[3] != 1)
        fail(fn, std::string(name) + " must have a contiguous last axis (stride 1), got stride " +
                     std::to_string(t.strides[3]));
}

FlashStrides strides_of(const TensorView& t) { return {t.strides[0], t.strides[1], t.strides[2]}; }

FlashStrides contiguous_strides(int64_t T, int64_t heads, int64_t D) {
    return {T * heads * D, heads * D, D};
}

// Sequence lengths and the normalised window share int32 arithmetic in the
// kernels, with p + right reaching Tk + Tq.
constexpr int64_t kMaxSeqLen = std::numeric_limits<int32_t>::max() / 2;

// The arrays of one call share q's dtype (the Python layer raises TypeError
// first; this keeps the core safe on its own).
void check_same_dtype(const char* fn, const char* name, const TensorView& t, const TensorView& q) {
    if (t.dtype != q.dtype)
        fail(fn, std::string(name) + " must have q's dtype " + dtype_name(q.dtype) + ", got " +
                     dtype_name(t.dtype));
}

FlashParams make_params(const char* fn, const TensorView& q, const TensorView& k,
                        const TensorView& v, const AttentionOptions& opt) {
    check_same_dtype(fn, "k", k, q);
    check_same_dtype(fn, "v", v, q);
    check_4d(fn, "q", "(B, Tq, H, D)", q);
    check_4d(fn, "k", "(B, Tk, Hkv, D)", k);
    check_4d(fn, "v", "(B, Tk, Hkv, D)", v);
    if (k.shape != v.shape)
        fail(fn, "k and v must have the same shape, got k " + shape_string(k.shape) + " and v " +
                     shape_string(v.shape));
    const int64_t B = q.shape[0], Tq = q.shape[1], H = q.shape[2], D = q.shape[3];
    const int64_t Tk = k.shape[1], Hkv = k.shape[2];
    // Built only for a message: a varlen call checks every sequence here.
    auto seen = [&] {
        return "; got q " + shape_string(q.shape) + " and k " + shape_string(k.shape);
    };
    if (k.shape[0] != B) fail(fn, "q and k must have the same batch size" + seen());
    if (k.shape[3] != D) fail(fn, "q and k must have the same head size D" + seen());
    if (D < 1 || D > kMaxHeadDim)
        fail(fn, "head size D must be in 1.." + std::to_string(kMaxHeadDim) + ", got " +
                     std::to_string(D) + " (q shape " + shape_string(q.shape) + ")");
    if (H < 1 || Hkv < 1) fail(fn, "the number of heads must be at least 1" + seen());
    if (H % Hkv != 0)
        fail(fn, "the number of query heads H=" + std::to_string(H) +
                     " must be a multiple of the number of kv heads Hkv=" + std::to_string(Hkv) +
                     seen());
    if (Tq > kMaxSeqLen || Tk > kMaxSeqLen || B > kMaxSeqLen || H > kMaxSeqLen)
        fail(fn, "B, Tq, Tk and H must each be at most " + std::to_string(kMaxSeqLen) + seen());
    if (opt.window_left < -1 || opt.window_right < -1)
        fail(fn, "window must be a pair of ints >= -1 (-1: unbounded), got (" +
                     std::to_string(opt.window_left) + ", " + std::to_string(opt.window_right) +
                     ")");
    double scale = 1.0 / std::sqrt(double(D));
    if (opt.scale) {
        // The kernels compute in float32: a finite double beyond its range is inf there.
        if (!std::isfinite(*opt.scale) || !std::isfinite(float(*opt.scale)))
            fail(fn, "scale must be finite in float32, got " + std::to_string(*opt.scale));
        scale = *opt.scale;
    }

    FlashParams p{};
    p.B = fa_int(B), p.Tq = fa_int(Tq), p.Tk = fa_int(Tk), p.H = fa_int(H), p.Hkv = fa_int(Hkv);
    p.D = fa_int(D);
    p.group = fa_int(H / Hkv);
    p.kv_splits = 1;
    // The one place where the window and causal rules meet (see flash_params.h).
    int64_t left = opt.window_left < 0 ? Tk : std::min(opt.window_left, Tk);
    int64_t right = opt.window_right < 0 ? Tq : std::min(opt.window_right, Tq);
    if (opt.causal) right = 0;
    p.window_left = fa_int(left);
    p.window_right = fa_int(right);
    p.scale = float(scale);
    p.q = strides_of(q), p.k = strides_of(k), p.v = strides_of(v);
    p.o = contiguous_strides(Tq, H, D);
    p.dout = p.o;
    p.dq = p.o;
    p.dk = p.dv = contiguous_strides(Tk, Hkv, D);
    return p;
}

}  // namespace

FlashParams make_forward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                                const AttentionOptions& options) {
    return make_params("attention", q, k, v, options);
}

void check_call_shapes(const std::string& fn, const std::vector<int64_t>& q_shape,
                       const std::vector<int64_t>& k_shape, const std::vector<int64_t>& v_shape,
                       const AttentionOptions& options) {
    auto view = [](const std::vector<int64_t>& shape) {
        TensorView t;
        t.shape = shape;
        t.strides.assign(shape.size(), 1);  // contiguous last axis: only shapes are judged
        for (size_t a = shape.size(); a-- > 1;) t.strides[a - 1] = t.strides[a] * shape[a];
        return t;
    };
    (void)make_params(fn.c_str(), view(q_shape), view(k_shape), view(v_shape), options);
}

ScoreInputs make_score_inputs(const char* fn, FlashParams& p, const ScoreOptions& opt) {
    ScoreInputs in;
    p.score_mods = 0;
    if (opt.softcap != 0.0) {
        if (!(opt.softcap > 0.0) || !std::isfinite(float(opt.softcap)))
            fail(fn, "softcap must be 0 (off) or positive and finite in float32, got " +
                         std::to_string(opt.softcap));
        p.score_mods |= FA_SCORE_SOFTCAP;
        in.params.softcap = float(opt.softcap);
    }
    if (opt.alibi_slopes) {
        const TensorView& a = *opt.alibi_slopes;
        const std::vector<int64_t> want = {p.B, p.H};
        if (a.shape != want)
            fail(fn, "alibi_slopes must have shape (B, H) = " + shape_string(want) +
                         " once broadcast, got " + shape_string(a.shape));
        // An empty (0, H) array is never read (NumPy may give it any strides).
        if (p.B > 0 && p.H > 1 && a.strides[1] != 1)
            fail(fn, "alibi_slopes must be contiguous along H, got strides " +
                         shape_string(a.strides));
        p.score_mods |= FA_SCORE_ALIBI;
        if (a.dtype != DType::f32) fail(fn, "alibi_slopes must be float32");
        in.alibi_slopes = static_cast<const float*>(a.data);
        in.params.alibi_b = fa_int(p.B > 1 ? a.strides[0] : 0);
    }
    if (opt.mask) {
        const TensorView& m = *opt.mask;
        const std::vector<int64_t> want = {p.B, p.H, p.Tq, p.Tk};
        if (m.shape != want)
            fail(fn, "mask must have shape (B, H, Tq, Tk) = " + shape_string(want) +
                         " once broadcast, got " + shape_string(m.shape));
        p.score_mods |= opt.mask_is_bool ? FA_SCORE_MASK_BOOL : FA_SCORE_MASK_FLOAT;
        in.mask = m.data;
        in.params.mask_b = m.strides[0], in.params.mask_h = m.strides[1];
        in.params.mask_i = m.strides[2], in.params.mask_j = m.strides[3];
    }
    if (opt.sinks) {
        const TensorView& k = *opt.sinks;
        const std::vector<int64_t> want = {p.H};
        if (k.shape != want || (p.H > 1 && k.strides[0] != 1))
            fail(fn, "sinks must have shape (H,) = " + shape_string(want) +
                         " and be contiguous, got shape " + shape_string(k.shape));
        p.score_mods |= FA_SCORE_SINKS;
        if (k.dtype != DType::f32) fail(fn, "sinks must be float32");
        in.sinks = static_cast<const float*>(k.data);
    }
    return in;
}

FlashParams make_backward_params(const TensorView& dout, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& o, const TensorView& lse,
                                 const AttentionOptions& options) {
    const char* fn = "attention_backward";
    FlashParams p = make_params(fn, q, k, v, options);
    check_4d(fn, "do", "(B, Tq, H, D)", dout);
    check_4d(fn, "o", "(B, Tq, H, D)", o);
    check_same_dtype(fn, "do", dout, q);
    check_same_dtype(fn, "o", o, q);
    if (lse.dtype != DType::f32)
        fail(fn, std::string("lse must be float32, got ") + dtype_name(lse.dtype));
    if (dout.shape != q.shape)
        fail(fn, "do must have the shape of q " + shape_string(q.shape) + ", got " +
                     shape_string(dout.shape));
    if (o.shape != q.shape)
        fail(fn, "o must have the shape of q " + shape_string(q.shape) + ", got " +
                     shape_string(o.shape));
    const std::vector<int64_t> lse_shape = {p.B, p.H, p.Tq};
    if (lse.shape != lse_shape)
        fail(fn, "lse must have shape (B, H, Tq) = " + shape_string(lse_shape) + ", got " +
                     shape_string(lse.shape));
    // An empty lse is never read: its strides do not matter.
    const std::vector<int64_t> lse_strides = {int64_t(p.H) * p.Tq, p.Tq, 1};
    if (lse_elements(p) > 0)
        for (size_t a = 0; a < 3; ++a)
            if (lse.shape[a] > 1 && lse.strides[a] != lse_strides[a])
                fail(fn, "lse must be C-contiguous, got strides (in elements) " +
                             shape_string(lse.strides) + " for shape " + shape_string(lse.shape));
    p.dout = strides_of(dout);
    p.o = strides_of(o);
    return p;
}

}  // namespace flashattn
