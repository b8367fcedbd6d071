// XLA FFI handlers for flashattn.jax: forward and backward, plain and varlen,
// on the cpu engine, called by XLA's CPU runtime from a jitted program with
// no Python (and no GIL) involved. xla_bindings.cpp exports them from
// flashattn._core as capsules that jax.ffi.register_ffi_target takes.
//
// Buffers arrive row-major and dense. q, k, v, do, o and the gradients share
// one dtype (float32, float16 or bfloat16); lse, the ALiBi slopes, a float
// mask, the sinks and dsinks are float32, a bool mask is PRED (one byte).
//
// Attributes: causal (bool), window_left, window_right (int), scale (float),
// and, for the score options (each defaulting to off): softcap (float),
// alibi (bool: a slopes buffer follows), mask (int: 0 none, 1 bool, 2 float
// buffer follows), sinks (bool: a sinks buffer follows, and the backward
// returns dsinks). The option buffers come after the call's arrays in that
// order: alibi (B, H), mask (mB, mH, mTq, mTk) each 1 or the call's size
// (a 1 broadcasts), sinks (H,).
//
// jax.vmap ("broadcast_all") adds leading axes to every operand: they fold
// into B when nothing stands in the way, else the handler runs once per
// index of those axes (with sinks, whose gradient is per index, or a mask
// whose B is 1 while B is not).
#include <cmath>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bindings/xla_handlers.h"
#include "core/engine.h"
#include "core/params.h"
#include "core/registry.h"
#include "core/varlen.h"

namespace flashattn {
namespace {

using namespace xla_ffi;

xla_ffi::Error* make_error(const CallFrame* frame, ErrorCode code, const std::string& message) {
    ErrorCreateArgs args{};
    args.struct_size = sizeof(ErrorCreateArgs);
    args.message = message.c_str();
    args.errc = code;
    return frame->api->error_create(&args);
}

// Answers XLA's metadata query (made at registration); true if it was one.
bool answer_metadata(CallFrame* frame) {
    for (ExtensionBase* ext = frame->extension_start; ext; ext = ext->next) {
        if (ext->type != kExtensionMetadata) continue;
        Metadata* md = reinterpret_cast<MetadataExtension*>(ext)->metadata;
        md->api_version.major_version = kApiMajor;
        md->api_version.minor_version = kApiMinor;
        md->traits = 0;
        return true;
    }
    return false;
}

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument(what); }

const char* xla_dtype_name(int code) {
    switch (code) {
        case kPred: return "bool";
        case kS32: return "int32";
        case kS64: return "int64";
        case kF16: return "float16";
        case kF32: return "float32";
        case kF64: return "float64";
        case kBF16: return "bfloat16";
        default: return "another dtype";
    }
}

// Argument or result i, a buffer; its dtype is judged by the caller.
const Buffer& buffer(const CallFrame* frame, bool ret, int64_t i, const char* name) {
    const int64_t size = ret ? frame->rets.size : frame->args.size;
    if (i >= size) fail(std::string("missing buffer ") + name);
    const int type = ret ? int(frame->rets.types[i]) : int(frame->args.types[i]);
    if (type != 1) fail(std::string(name) + " is not a buffer");
    return *static_cast<const Buffer*>(ret ? frame->rets.rets[i] : frame->args.args[i]);
}

void need_dtype(const Buffer& b, const char* name, DataType want) {
    if (b.dtype != want)
        fail(std::string(name) + " must be " + xla_dtype_name(want) + ", got " +
             xla_dtype_name(b.dtype) + " (XLA dtype code " + std::to_string(int(b.dtype)) + ")");
}

// The call's dtype, from q: float32, float16 or bfloat16.
DType data_dtype(const Buffer& q) {
    switch (q.dtype) {
        case kF32: return DType::f32;
        case kF16: return DType::f16;
        case kBF16: return DType::bf16;
        default:
            fail(std::string("q must be float32, float16 or bfloat16, got ") +
                 xla_dtype_name(q.dtype) + " (XLA dtype code " + std::to_string(int(q.dtype)) +
                 ")");
    }
}

DataType xla_code(DType d) { return d == DType::f32 ? kF32 : d == DType::f16 ? kF16 : kBF16; }

const Scalar* find_attribute(const CallFrame* frame, std::string_view name) {
    for (int64_t i = 0; i < frame->attrs.size; ++i) {
        const ByteSpan* n = frame->attrs.names[i];
        if (std::string_view(n->ptr, n->len) != name) continue;
        if (frame->attrs.types[i] != kAttrScalar) break;
        return static_cast<const Scalar*>(frame->attrs.attrs[i]);
    }
    return nullptr;
}

const Scalar& attribute(const CallFrame* frame, std::string_view name) {
    if (const Scalar* s = find_attribute(frame, name)) return *s;
    fail("missing scalar attribute " + std::string(name));
}

int64_t int_of(const Scalar& s, std::string_view name) {
    switch (s.dtype) {
        case kPred: return *static_cast<const bool*>(s.value) ? 1 : 0;
        case kS32: return *static_cast<const int32_t*>(s.value);
        case kS64: return *static_cast<const int64_t*>(s.value);
        default: fail("attribute " + std::string(name) + " must be an int");
    }
}

double float_of(const Scalar& s, std::string_view name) {
    switch (s.dtype) {
        case kF32: return *static_cast<const float*>(s.value);
        case kF64: return *static_cast<const double*>(s.value);
        default: fail("attribute " + std::string(name) + " must be a float");
    }
}

int64_t int_attribute(const CallFrame* frame, std::string_view name) {
    return int_of(attribute(frame, name), name);
}

// The score options' attributes are optional: absent means off.
int64_t optional_int(const CallFrame* frame, std::string_view name) {
    const Scalar* s = find_attribute(frame, name);
    return s ? int_of(*s, name) : 0;
}

AttentionOptions options_of(const CallFrame* frame) {
    AttentionOptions opt;
    opt.causal = int_attribute(frame, "causal") != 0;
    opt.window_left = int_attribute(frame, "window_left");
    opt.window_right = int_attribute(frame, "window_right");
    opt.scale = float_of(attribute(frame, "scale"), "scale");
    return opt;
}

// Which score options a call has, and where their buffers start.
struct ScoreLayout {
    double softcap = 0.0;
    bool alibi = false;
    int mask = 0;  // 0 none, 1 bool, 2 float
    bool sinks = false;
    int64_t first = 0;  // index of the first option buffer among the arguments

    int64_t count() const { return int64_t(alibi) + int64_t(mask != 0) + int64_t(sinks); }
};

ScoreLayout score_layout_of(const CallFrame* frame, int64_t first) {
    ScoreLayout s;
    if (const Scalar* c = find_attribute(frame, "softcap")) s.softcap = float_of(*c, "softcap");
    s.alibi = optional_int(frame, "alibi") != 0;
    s.mask = int(optional_int(frame, "mask"));
    if (s.mask < 0 || s.mask > 2) fail("attribute mask must be 0, 1 or 2");
    s.sinks = optional_int(frame, "sinks") != 0;
    s.first = first;
    return s;
}

std::string dims_string(const Buffer& b) {
    return shape_string(std::vector<int64_t>(b.dims, b.dims + b.rank));
}

// ---- Leading (vmap) axes
//
// Every operand is (lead..., inner...) with `inner` its own axes (4 for q,
// 3 for lse, 2 for the slopes, 1 for sinks); lead must be the result's own
// lead, or all ones (a size-1 axis broadcasts).
struct Operand {
    const Buffer* b = nullptr;
    const char* name = "";
    int inner = 0;
    int64_t outer_stride = 0;  // elements between consecutive lead indices (0: broadcast)

    std::vector<int64_t> inner_dims() const {
        return std::vector<int64_t>(b->dims + (b->rank - inner), b->dims + b->rank);
    }
    int64_t inner_size() const {
        int64_t n = 1;
        for (int64_t d : inner_dims()) n *= d;
        return n;
    }
};

struct Lead {
    std::vector<int64_t> dims;
    int64_t count = 1;  // their product
};

Lead lead_of(const Buffer& out, int inner, const char* name) {
    if (out.rank < inner)
        fail(std::string(name) + " must have at least " + std::to_string(inner) +
             " dimensions, got " + dims_string(out));
    Lead l;
    l.dims.assign(out.dims, out.dims + (out.rank - inner));
    for (int64_t d : l.dims) l.count *= d;
    return l;
}

Operand operand(const Buffer& b, const char* name, int inner, const Lead& lead) {
    Operand o{&b, name, inner, 0};
    const int64_t n_lead = int64_t(lead.dims.size());
    if (b.rank != n_lead + inner)
        fail(std::string(name) + " has shape " + dims_string(b) +
             ", whose leading axes do not match q's");
    bool same = true, ones = true;
    for (int64_t i = 0; i < n_lead; ++i) {
        same = same && b.dims[i] == lead.dims[size_t(i)];
        ones = ones && b.dims[i] == 1;
    }
    if (!same && !ones)
        fail(std::string(name) + " has shape " + dims_string(b) +
             ", whose leading axes do not match q's");
    o.outer_stride = (same && lead.count > 1) ? o.inner_size() : 0;
    return o;
}

size_t element_size(const Buffer& b) {
    switch (b.dtype) {
        case kPred: return 1;
        case kF16: case kBF16: return 2;
        case kF64: case kS64: return 8;
        default: return 4;
    }
}

// The operand at lead index `outer` (or, folded, all of them) as a dense
// view of `shape`, whose first axis may absorb the lead axes.
TensorView view_at(const Operand& op, int64_t outer, std::vector<int64_t> shape, DType dtype) {
    TensorView t;
    t.data = static_cast<const char*>(op.b->data) +
             outer * op.outer_stride * int64_t(element_size(*op.b));
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.strides.assign(t.shape.size(), 1);
    for (int64_t i = int64_t(t.shape.size()) - 2; i >= 0; --i)
        t.strides[size_t(i)] = t.strides[size_t(i) + 1] * t.shape[size_t(i) + 1];
    return t;
}

void* mutable_data(const TensorView& t) { return const_cast<void*>(t.data); }

void check_output(const Operand& out, const std::vector<int64_t>& expected) {
    if (out.inner_dims() != expected)
        fail(std::string(out.name) + " has shape " + dims_string(*out.b) + ", expected " +
             shape_string(expected) + " after the leading axes");
}

// Argument i, an option buffer (alibi_slopes, mask, sinks) of `dtype`.
const Buffer& option_buffer(const CallFrame* frame, int64_t i, const char* name, DataType dtype) {
    const Buffer& b = buffer(frame, false, i, name);
    need_dtype(b, name, dtype);
    return b;
}

// The option buffers of a call, as operands.
struct ScoreOperands {
    ScoreLayout layout;
    Operand alibi, mask, sinks;
};

ScoreOperands score_operands(const CallFrame* frame, const ScoreLayout& layout, const Lead& lead) {
    ScoreOperands s{layout, {}, {}, {}};
    int64_t i = layout.first;
    if (layout.alibi)
        s.alibi = operand(option_buffer(frame, i++, "alibi_slopes", kF32), "alibi_slopes", 2, lead);
    if (layout.mask)
        s.mask = operand(option_buffer(frame, i++, "mask", layout.mask == 1 ? kPred : kF32), "mask",
                         4, lead);
    if (layout.sinks)
        s.sinks = operand(option_buffer(frame, i++, "sinks", kF32), "sinks", 1, lead);
    return s;
}

// The score options of one engine call of batch Bc (B, or B times the lead
// axes when they fold) as the core takes them; the mask's size-1 axes
// broadcast (stride 0). Folding keeps B-sized axes dense (can_fold).
ScoreOptions score_options_at(const ScoreOperands& s, int64_t outer, int64_t B, int64_t Bc,
                              int64_t H, int64_t Tq, int64_t Tk) {
    ScoreOptions out;
    out.softcap = s.layout.softcap;
    if (s.layout.alibi) {
        if (s.alibi.inner_dims() != std::vector<int64_t>{B, H})
            fail("alibi_slopes has shape " + dims_string(*s.alibi.b) + ", expected (B, H) = " +
                 shape_string({B, H}) + " after the leading axes");
        out.alibi_slopes = view_at(s.alibi, outer, {Bc, H}, DType::f32);
    }
    if (s.layout.mask) {
        const std::vector<int64_t> m = s.mask.inner_dims();
        const std::vector<int64_t> want = {B, H, Tq, Tk};
        TensorView t = view_at(s.mask, outer, m, DType::f32);
        for (size_t a = 0; a < 4; ++a) {
            if (m[a] == want[a]) continue;
            if (m[a] != 1)
                fail("mask has shape " + dims_string(*s.mask.b) +
                     ", which does not broadcast to (B, H, Tq, Tk) = " + shape_string(want));
            t.strides[a] = 0;
        }
        t.shape = {Bc, H, Tq, Tk};
        out.mask = t;
        out.mask_is_bool = s.layout.mask == 1;
    }
    if (s.layout.sinks) out.sinks = view_at(s.sinks, outer, {H}, DType::f32);
    return out;
}

// Whether the lead axes can fold into B: every operand has them in full
// (dense), no sinks (their gradient is per lead index), and a mask with B
// of 1 only when B is 1.
bool can_fold(const Lead& lead, const std::vector<Operand>& ops, const ScoreOperands& s,
              int64_t B) {
    if (lead.count <= 1) return false;
    if (s.layout.sinks) return false;
    for (const Operand& op : ops)
        if (op.outer_stride == 0) return false;
    if (s.layout.alibi && s.alibi.outer_stride == 0) return false;
    if (s.layout.mask && (s.mask.outer_stride == 0 || (s.mask.inner_dims()[0] == 1 && B != 1)))
        return false;
    return true;
}

template <class Body>
xla_ffi::Error* guarded(CallFrame* frame, const char* fn, Body body) {
    try {
        if (answer_metadata(frame)) return nullptr;
        body();
        return nullptr;
    } catch (const std::invalid_argument& e) {
        return make_error(frame, kInvalidArgument, std::string(fn) + ": " + e.what());
    } catch (const std::bad_alloc&) {
        return make_error(frame, kResourceExhausted, std::string(fn) + ": out of memory");
    } catch (const std::exception& e) {
        return make_error(frame, kInternal, std::string(fn) + ": " + e.what());
    }
}

// ---- Plain calls

void forward(CallFrame* frame) {
    const Buffer& qb = buffer(frame, false, 0, "q");
    const DType dt = data_dtype(qb);
    const Lead lead = lead_of(buffer(frame, true, 0, "o"), 4, "o");
    Operand q = operand(qb, "q", 4, lead);
    std::vector<Operand> ops = {q};
    const char* names[] = {"k", "v"};
    for (int i = 1; i <= 2; ++i) {
        const Buffer& b = buffer(frame, false, i, names[i - 1]);
        need_dtype(b, names[i - 1], xla_code(dt));
        ops.push_back(operand(b, names[i - 1], 4, lead));
    }
    const Buffer& ob = buffer(frame, true, 0, "o");
    const Buffer& lb = buffer(frame, true, 1, "lse");
    need_dtype(ob, "o", xla_code(dt));
    need_dtype(lb, "lse", kF32);
    const Operand o = operand(ob, "o", 4, lead), lse = operand(lb, "lse", 3, lead);
    const ScoreOperands score = score_operands(frame, score_layout_of(frame, 3), lead);
    const std::vector<int64_t> qd = ops[0].inner_dims(), kd = ops[1].inner_dims(),
                               vd = ops[2].inner_dims();
    const int64_t B = qd[0];
    const bool fold = can_fold(lead, ops, score, B);
    const int64_t calls = fold ? 1 : lead.count, Bc = fold ? B * lead.count : B;
    const AttentionOptions opt = options_of(frame);
    Engine& engine = get_engine("cpu");
    for (int64_t c = 0; c < calls; ++c) {
        const TensorView qv = view_at(ops[0], c, {Bc, qd[1], qd[2], qd[3]}, dt);
        const TensorView kv = view_at(ops[1], c, {Bc, kd[1], kd[2], kd[3]}, dt);
        const TensorView vv = view_at(ops[2], c, {Bc, vd[1], vd[2], vd[3]}, dt);
        FlashParams p = make_forward_params(qv, kv, vv, opt);
        const ScoreInputs in = make_score_inputs(
            "attention", p, score_options_at(score, c, B, Bc, p.H, p.Tq, p.Tk));
        check_output(o, qd);
        check_output(lse, {B, p.H, p.Tq});
        const TensorView ov = view_at(o, c, qv.shape, dt);
        const TensorView lv = view_at(lse, c, {Bc, p.H, p.Tq}, DType::f32);
        ForwardIO io{qv.data, kv.data, vv.data, mutable_data(ov),
                     static_cast<float*>(mutable_data(lv)), in};
        io.dtype = dt;
        run_forward(engine, p, io);
    }
}

void backward(CallFrame* frame) {
    const Buffer& qb = buffer(frame, false, 1, "q");
    const DType dt = data_dtype(qb);
    const Lead lead = lead_of(buffer(frame, true, 0, "dq"), 4, "dq");
    const char* names[] = {"do", "q", "k", "v", "o"};
    std::vector<Operand> ops;
    for (int i = 0; i < 5; ++i) {
        const Buffer& b = buffer(frame, false, i, names[i]);
        need_dtype(b, names[i], xla_code(dt));
        ops.push_back(operand(b, names[i], 4, lead));
    }
    const Buffer& lb = buffer(frame, false, 5, "lse");
    need_dtype(lb, "lse", kF32);
    const Operand lse = operand(lb, "lse", 3, lead);
    ops.push_back(lse);
    const char* grad_names[] = {"dq", "dk", "dv"};
    std::vector<Operand> grads;
    for (int i = 0; i < 3; ++i) {
        const Buffer& b = buffer(frame, true, i, grad_names[i]);
        need_dtype(b, grad_names[i], xla_code(dt));
        grads.push_back(operand(b, grad_names[i], 4, lead));
    }
    const ScoreOperands score = score_operands(frame, score_layout_of(frame, 6), lead);
    Operand dsinks;
    if (score.layout.sinks) {
        const Buffer& b = buffer(frame, true, 3, "dsinks");
        need_dtype(b, "dsinks", kF32);
        dsinks = operand(b, "dsinks", 1, lead);
    }
    const std::vector<int64_t> qd = ops[1].inner_dims(), kd = ops[2].inner_dims();
    const int64_t B = qd[0];
    const bool fold = can_fold(lead, ops, score, B);
    const int64_t calls = fold ? 1 : lead.count, Bc = fold ? B * lead.count : B;
    const AttentionOptions opt = options_of(frame);
    Engine& engine = get_engine("cpu");
    for (int64_t c = 0; c < calls; ++c) {
        std::vector<TensorView> v;
        for (int i = 0; i < 5; ++i) {
            const std::vector<int64_t> d = ops[size_t(i)].inner_dims();
            v.push_back(view_at(ops[size_t(i)], c, {Bc, d[1], d[2], d[3]}, dt));
        }
        const std::vector<int64_t> ld = lse.inner_dims();
        const TensorView lv = view_at(lse, c, {Bc, ld[1], ld[2]}, DType::f32);
        FlashParams p = make_backward_params(v[0], v[1], v[2], v[3], v[4], lv, opt);
        const ScoreInputs in = make_score_inputs(
            "attention_backward", p, score_options_at(score, c, B, Bc, p.H, p.Tq, p.Tk));
        check_output(grads[0], qd);
        check_output(grads[1], kd);
        check_output(grads[2], kd);
        const TensorView dq = view_at(grads[0], c, v[1].shape, dt);
        const TensorView dk = view_at(grads[1], c, v[2].shape, dt);
        const TensorView dv = view_at(grads[2], c, v[3].shape, dt);
        BackwardIO io{v[0].data, v[1].data, v[2].data, v[3].data, v[4].data,
                      static_cast<const float*>(lv.data), mutable_data(dq), mutable_data(dk),
                      mutable_data(dv), in};
        io.dtype = dt;
        if (score.layout.sinks) {
            check_output(dsinks, {p.H});
            io.dsinks = static_cast<float*>(mutable_data(view_at(dsinks, c, {p.H}, DType::f32)));
        }
        run_backward(engine, p, io);
    }
}

// ---- Varlen calls (no lead axes: flashattn.jax maps them sequentially)

TensorView dense(const Buffer& b, DType dtype) {
    Operand op{&b, "", int(b.rank), 0};
    return view_at(op, 0, op.inner_dims(), dtype);
}

Sequences sequences_of(const CallFrame* frame, int64_t i, int64_t total_q, int64_t total_k) {
    const Buffer& cq = buffer(frame, false, i, "cu_seqlens_q");
    const Buffer& ck = buffer(frame, false, i + 1, "cu_seqlens_k");
    need_dtype(cq, "cu_seqlens_q", kS32);
    need_dtype(ck, "cu_seqlens_k", kS32);
    if (cq.rank != 1 || ck.rank != 1) fail("cu_seqlens_q and cu_seqlens_k must have 1 dimension");
    return make_sequences("attention_varlen", static_cast<const int32_t*>(cq.data), cq.dims[0],
                          static_cast<const int32_t*>(ck.data), ck.dims[0], total_q, total_k);
}

ScoreOptions varlen_score(const CallFrame* frame, const ScoreLayout& layout) {
    if (layout.mask) fail("attention_varlen takes no mask");
    ScoreOptions s;
    s.softcap = layout.softcap;
    int64_t i = layout.first;
    if (layout.alibi)
        s.alibi_slopes = dense(option_buffer(frame, i++, "alibi_slopes", kF32), DType::f32);
    if (layout.sinks) s.sinks = dense(option_buffer(frame, i++, "sinks", kF32), DType::f32);
    return s;
}

void check_shape(const Buffer& b, const std::vector<int64_t>& want) {
    if (std::vector<int64_t>(b.dims, b.dims + b.rank) != want)
        fail("an output has shape " + dims_string(b) + ", expected " + shape_string(want));
}

void forward_varlen(CallFrame* frame) {
    const Buffer& qb = buffer(frame, false, 0, "q");
    const DType dt = data_dtype(qb);
    const Buffer& kb = buffer(frame, false, 1, "k");
    const Buffer& vb = buffer(frame, false, 2, "v");
    need_dtype(kb, "k", xla_code(dt));
    need_dtype(vb, "v", xla_code(dt));
    if (qb.rank != 3 || kb.rank != 3) fail("q and k must have 3 dimensions (total, heads, D)");
    const Sequences seqs = sequences_of(frame, 3, qb.dims[0], kb.dims[0]);
    const ScoreOptions score = varlen_score(frame, score_layout_of(frame, 5));
    const Buffer& ob = buffer(frame, true, 0, "o");
    const Buffer& lb = buffer(frame, true, 1, "lse");
    need_dtype(ob, "o", xla_code(dt));
    need_dtype(lb, "lse", kF32);
    check_shape(ob, {qb.dims[0], qb.dims[1], qb.dims[2]});
    check_shape(lb, {qb.dims[1], qb.dims[0]});
    run_forward_varlen(get_engine("cpu"), seqs, dense(qb, dt), dense(kb, dt), dense(vb, dt),
                       options_of(frame), score, ob.data, static_cast<float*>(lb.data));
}

void backward_varlen(CallFrame* frame) {
    const Buffer& qb = buffer(frame, false, 1, "q");
    const DType dt = data_dtype(qb);
    const char* names[] = {"do", "q", "k", "v", "o"};
    std::vector<TensorView> v;
    for (int i = 0; i < 5; ++i) {
        const Buffer& b = buffer(frame, false, i, names[i]);
        need_dtype(b, names[i], xla_code(dt));
        if (b.rank != 3) fail(std::string(names[i]) + " must have 3 dimensions (total, heads, D)");
        v.push_back(dense(b, dt));
    }
    const Buffer& lb = buffer(frame, false, 5, "lse");
    need_dtype(lb, "lse", kF32);
    check_shape(lb, {v[1].shape[1], v[1].shape[0]});
    const Sequences seqs = sequences_of(frame, 6, v[1].shape[0], v[2].shape[0]);
    const ScoreLayout layout = score_layout_of(frame, 8);
    const ScoreOptions score = varlen_score(frame, layout);
    void* out[3];
    const char* grad_names[] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; ++i) {
        const Buffer& b = buffer(frame, true, i, grad_names[i]);
        need_dtype(b, grad_names[i], xla_code(dt));
        check_shape(b, v[size_t(i) + 1].shape);
        out[i] = b.data;
    }
    float* dsinks = nullptr;
    if (layout.sinks) {
        const Buffer& b = buffer(frame, true, 3, "dsinks");
        need_dtype(b, "dsinks", kF32);
        check_shape(b, {v[1].shape[1]});
        dsinks = static_cast<float*>(b.data);
    }
    run_backward_varlen(get_engine("cpu"), seqs, v[0], v[1], v[2], v[3], v[4],
                        static_cast<const float*>(lb.data), options_of(frame), score, out[0],
                        out[1], out[2], dsinks);
}

}  // namespace

// args: q, k, v, then the option buffers; rets: o, lse.
xla_ffi::Error* xla_attention_forward(xla_ffi::CallFrame* frame) {
    return guarded(frame, "flashattn.jax", [&] { forward(frame); });
}

// args: do, q, k, v, o, lse, then the option buffers; rets: dq, dk, dv (and dsinks).
xla_ffi::Error* xla_attention_backward(xla_ffi::CallFrame* frame) {
    return guarded(frame, "flashattn.jax (backward)", [&] { backward(frame); });
}

// args: q, k, v, cu_seqlens_q, cu_seqlens_k (int32), then alibi, sinks; rets: o, lse.
xla_ffi::Error* xla_attention_varlen_forward(xla_ffi::CallFrame* frame) {
    return guarded(frame, "flashattn.jax.attention_varlen", [&] { forward_varlen(frame); });
}

// args: do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, then alibi, sinks;
// rets: dq, dk, dv (and dsinks).
xla_ffi::Error* xla_attention_varlen_backward(xla_ffi::CallFrame* frame) {
    return guarded(frame, "flashattn.jax.attention_varlen (backward)",
                   [&] { backward_varlen(frame); });
}

}  // namespace flashattn
