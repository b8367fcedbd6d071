// The XLA FFI handlers (cpp/bindings/xla_handlers.cpp) driven by hand-built
// call frames, as XLA's CPU runtime would: the metadata query is answered,
// results are bit-identical to the cpu engine called directly, vmap's extra
// leading axes fold into B, and bad frames come back as XLA errors carrying
// the message, never as a crash.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "bindings/xla_handlers.h"
#include "check.h"
#include "core/engine.h"
#include "core/params.h"
#include "core/registry.h"

// The opaque error type, made concrete for the test's fake error_create.
namespace flashattn::xla_ffi {
struct Error {
    ErrorCode code;
    std::string message;
};
}  // namespace flashattn::xla_ffi

using namespace flashattn;
using namespace flashattn::xla_ffi;

namespace {

Error* fake_error_create(ErrorCreateArgs* args) { return new Error{args->errc, args->message}; }

Api fake_api() {
    Api api{};
    api.struct_size = sizeof(Api);
    api.error_create = &fake_error_create;
    return api;
}

struct Array {
    std::vector<int64_t> dims;
    std::vector<float> data;
    DataType dtype = kF32;
};

Array random_array(std::vector<int64_t> dims, std::mt19937& rng) {
    Array a{dims, {}};
    size_t n = 1;
    for (int64_t d : dims) n *= size_t(d);
    std::normal_distribution<float> normal;
    a.data.resize(n);
    for (float& x : a.data) x = normal(rng);
    return a;
}

Array zeros(std::vector<int64_t> dims) {
    size_t n = 1;
    for (int64_t d : dims) n *= size_t(d);
    return Array{dims, std::vector<float>(n, 0.0f)};
}

struct Attribute {
    std::string name;
    DataType dtype;
    int64_t i = 0;
    double f = 0;
    bool b = false;
};

// Owns everything a CallFrame points to.
class Frame {
public:
    Frame(std::vector<Array*> args, std::vector<Array*> rets, std::vector<Attribute> attrs)
        : attrs_(std::move(attrs)) {
        api_ = fake_api();
        for (auto* list : {&args, &rets}) {
            auto& bufs = list == &args ? arg_bufs_ : ret_bufs_;
            bufs.reserve(list->size());
            for (Array* a : *list) {
                bufs.push_back(Buffer{sizeof(Buffer), nullptr, a->dtype, a->data.data(),
                                      int64_t(a->dims.size()), a->dims.data()});
            }
        }
        for (auto& b : arg_bufs_) { arg_types_.push_back(kArgBuffer); arg_ptrs_.push_back(&b); }
        for (auto& b : ret_bufs_) { ret_types_.push_back(kRetBuffer); ret_ptrs_.push_back(&b); }
        names_.reserve(attrs_.size());
        scalars_.reserve(attrs_.size());
        for (auto& a : attrs_) {
            names_.push_back(ByteSpan{a.name.data(), a.name.size()});
            void* value = a.dtype == kPred ? static_cast<void*>(&a.b)
                        : a.dtype == kF64  ? static_cast<void*>(&a.f)
                                           : static_cast<void*>(&a.i);
            scalars_.push_back(Scalar{a.dtype, value});
        }
        for (size_t i = 0; i < attrs_.size(); ++i) {
            attr_types_.push_back(kAttrScalar);
            name_ptrs_.push_back(&names_[i]);
            attr_ptrs_.push_back(&scalars_[i]);
        }
        frame_ = CallFrame{};
        frame_.struct_size = sizeof(CallFrame);
        frame_.api = &api_;
        frame_.stage = 3;  // execute
        frame_.args = Args{sizeof(Args), nullptr, int64_t(arg_ptrs_.size()), arg_types_.data(),
                           arg_ptrs_.data()};
        frame_.rets = Rets{sizeof(Rets), nullptr, int64_t(ret_ptrs_.size()), ret_types_.data(),
                           ret_ptrs_.data()};
        frame_.attrs = Attrs{sizeof(Attrs), nullptr, int64_t(attr_ptrs_.size()),
                             attr_types_.data(), name_ptrs_.data(), attr_ptrs_.data()};
    }

    CallFrame* get() { return &frame_; }

private:
    Api api_;
    std::vector<Attribute> attrs_;
    std::vector<Buffer> arg_bufs_, ret_bufs_;
    std::vector<ArgType> arg_types_;
    std::vector<RetType> ret_types_;
    std::vector<void*> arg_ptrs_, ret_ptrs_, attr_ptrs_;
    std::vector<AttrType> attr_types_;
    std::vector<ByteSpan> names_;
    std::vector<ByteSpan*> name_ptrs_;
    std::vector<Scalar> scalars_;
    CallFrame frame_;
};

std::vector<Attribute> attributes(bool causal, int64_t left, int64_t right, double scale) {
    return {Attribute{"causal", kPred, 0, 0, causal}, Attribute{"scale", kF64, 0, scale},
            Attribute{"window_left", kS64, left}, Attribute{"window_right", kS64, right}};
}

TensorView view(const Array& a) {
    TensorView t;
    t.data = a.data.data();
    t.shape = a.dims;
    t.strides.assign(a.dims.size(), 1);
    for (int i = int(a.dims.size()) - 2; i >= 0; --i) t.strides[i] = t.strides[i + 1] * a.dims[i + 1];
    return t;
}

// Returns the error's message ("" for success) and frees it.
std::string run(Error* (*handler)(CallFrame*), Frame& frame, ErrorCode* code = nullptr) {
    Error* e = handler(frame.get());
    if (!e) return "";
    std::string msg = e->message;
    if (code) *code = e->code;
    delete e;
    return msg;
}

void test_metadata_query_is_answered() {
    Metadata md{};
    md.struct_size = sizeof(Metadata);
    md.traits = 7;
    MetadataExtension ext{{sizeof(MetadataExtension), kExtensionMetadata, nullptr}, &md};
    Frame frame({}, {}, {});
    frame.get()->extension_start = &ext.extension_base;
    for (auto* handler : {&xla_attention_forward, &xla_attention_backward}) {
        md.api_version = ApiVersion{};
        CHECK(run(handler, frame) == "");
        CHECK(md.api_version.major_version == 0);
        CHECK(md.api_version.minor_version == kApiMinor);
        CHECK(md.traits == 0);
    }
}

void test_forward_and_backward_equal_the_cpu_engine() {
    std::mt19937 rng(1);
    Array q = random_array({2, 5, 4, 8}, rng), k = random_array({2, 7, 2, 8}, rng);
    Array v = random_array({2, 7, 2, 8}, rng), dout = random_array({2, 5, 4, 8}, rng);
    Array o = zeros({2, 5, 4, 8}), lse = zeros({2, 4, 5});
    const auto attrs = attributes(true, 3, -1, 0.3);
    Frame fwd({&q, &k, &v}, {&o, &lse}, attrs);
    CHECK(run(&xla_attention_forward, fwd) == "");

    AttentionOptions opt;
    opt.causal = true;
    opt.window_left = 3;
    opt.scale = 0.3;
    Engine& cpu = get_engine("cpu");
    const FlashParams p = make_forward_params(view(q), view(k), view(v), opt);
    Array o_want = zeros(o.dims), lse_want = zeros(lse.dims);
    run_forward(cpu, p, {q.data.data(), k.data.data(), v.data.data(), o_want.data.data(),
                         lse_want.data.data()});
    CHECK(o.data == o_want.data);
    CHECK(lse.data == lse_want.data);

    Array dq = zeros(q.dims), dk = zeros(k.dims), dv = zeros(v.dims);
    Frame bwd({&dout, &q, &k, &v, &o, &lse}, {&dq, &dk, &dv}, attrs);
    CHECK(run(&xla_attention_backward, bwd) == "");
    const FlashParams pb = make_backward_params(view(dout), view(q), view(k), view(v), view(o),
                                                view(lse), opt);
    Array dq_want = zeros(q.dims), dk_want = zeros(k.dims), dv_want = zeros(v.dims);
    run_backward(cpu, pb, {dout.data.data(), q.data.data(), k.data.data(), v.data.data(),
                           o.data.data(), lse.data.data(), dq_want.data.data(),
                           dk_want.data.data(), dv_want.data.data()});
    CHECK(dq.data == dq_want.data);
    CHECK(dk.data == dk_want.data);
    CHECK(dv.data == dv_want.data);
}

void test_vmapped_leading_axes_fold_into_the_batch() {
    std::mt19937 rng(2);
    Array q = random_array({3, 2, 6, 2, 4}, rng), k = random_array({3, 2, 9, 1, 4}, rng);
    Array v = random_array({3, 2, 9, 1, 4}, rng);
    Array o = zeros(q.dims), lse = zeros({3, 2, 2, 6});
    Frame folded({&q, &k, &v}, {&o, &lse}, attributes(false, -1, -1, 0.5));
    CHECK(run(&xla_attention_forward, folded) == "");

    Array q4{{6, 6, 2, 4}, q.data}, k4{{6, 9, 1, 4}, k.data}, v4{{6, 9, 1, 4}, v.data};
    Array o4 = zeros(q4.dims), lse4 = zeros({6, 2, 6});
    Frame flat({&q4, &k4, &v4}, {&o4, &lse4}, attributes(false, -1, -1, 0.5));
    CHECK(run(&xla_attention_forward, flat) == "");
    CHECK(o.data == o4.data);
    CHECK(lse.data == lse4.data);
}

// With sinks (whose gradient is per lead index) the lead axes do not fold:
// each index runs as its own call, and gives what that call alone gives.
void test_sinks_under_lead_axes_run_once_per_index() {
    std::mt19937 rng(4);
    Array q = random_array({2, 1, 5, 2, 4}, rng), k = random_array({2, 1, 7, 2, 4}, rng);
    Array v = random_array({2, 1, 7, 2, 4}, rng), dout = random_array({2, 1, 5, 2, 4}, rng);
    Array sinks = random_array({2, 2}, rng);
    Array mask{{1, 1, 1, 5, 7}, {}, kPred};  // bool, broadcast over the lead axis and heads
    mask.data.resize(9);  // 35 bytes in float-sized storage
    auto* bytes = reinterpret_cast<uint8_t*>(mask.data.data());
    for (int i = 0; i < 35; ++i) bytes[i] = (i * 7) % 5 != 0;
    auto attrs = attributes(true, -1, -1, 0.5);
    attrs.push_back(Attribute{"sinks", kPred, 0, 0, true});
    attrs.push_back(Attribute{"mask", kS64, 1});
    attrs.push_back(Attribute{"softcap", kF64, 0, 2.5});
    Array o = zeros(q.dims), lse = zeros({2, 1, 2, 5});
    Frame fwd({&q, &k, &v, &mask, &sinks}, {&o, &lse}, attrs);
    CHECK(run(&xla_attention_forward, fwd) == "");
    Array dq = zeros(q.dims), dk = zeros(k.dims), dv = zeros(v.dims), ds = zeros({2, 2});
    Frame bwd({&dout, &q, &k, &v, &o, &lse, &mask, &sinks}, {&dq, &dk, &dv, &ds}, attrs);
    CHECK(run(&xla_attention_backward, bwd) == "");
    for (int64_t i = 0; i < 2; ++i) {
        auto part = [&](const Array& a) {
            const size_t n = a.data.size() / 2;
            std::vector<int64_t> dims(a.dims.begin() + 1, a.dims.end());
            return Array{dims, std::vector<float>(a.data.begin() + i * n,
                                                  a.data.begin() + (i + 1) * n)};
        };
        Array qi = part(q), ki = part(k), vi = part(v), di = part(dout), si = part(sinks);
        Array mi{{1, 1, 5, 7}, mask.data, kPred};
        Array oi = zeros(qi.dims), li = zeros({1, 2, 5});
        Frame f({&qi, &ki, &vi, &mi, &si}, {&oi, &li}, attrs);
        CHECK(run(&xla_attention_forward, f) == "");
        CHECK(oi.data == part(o).data);
        CHECK(li.data == part(lse).data);
        Array gq = zeros(qi.dims), gk = zeros(ki.dims), gv = zeros(vi.dims), gs = zeros({2});
        Frame b({&di, &qi, &ki, &vi, &oi, &li, &mi, &si}, {&gq, &gk, &gv, &gs}, attrs);
        CHECK(run(&xla_attention_backward, b) == "");
        CHECK(gq.data == part(dq).data);
        CHECK(gk.data == part(dk).data);
        CHECK(gv.data == part(dv).data);
        CHECK(gs.data == part(ds).data);
    }
}

bool contains(const std::string& s, const std::string& needle) {
    return s.find(needle) != std::string::npos;
}

void test_bad_frames_are_errors_with_messages() {
    std::mt19937 rng(3);
    Array q = random_array({1, 4, 2, 8}, rng), k = random_array({1, 4, 2, 8}, rng);
    Array v = random_array({1, 4, 2, 8}, rng);
    Array o = zeros(q.dims), lse = zeros({1, 2, 4});
    ErrorCode code{};

    Array q64 = q;
    q64.dtype = kF64;
    Frame wrong_dtype({&q64, &k, &v}, {&o, &lse}, attributes(false, -1, -1, 0.5));
    const std::string dtype_msg = run(&xla_attention_forward, wrong_dtype, &code);
    CHECK(contains(dtype_msg, "flashattn.jax: q must be float32, float16 or bfloat16, got "
                              "float64"));
    CHECK(code == kInvalidArgument);

    auto no_scale = attributes(false, -1, -1, 0.5);
    no_scale.erase(no_scale.begin() + 1);
    Frame missing({&q, &k, &v}, {&o, &lse}, no_scale);
    CHECK(contains(run(&xla_attention_forward, missing), "missing scalar attribute scale"));

    Array q3 = random_array({3, 1, 4, 2, 8}, rng), o3 = zeros({3, 1, 4, 2, 8});
    Array k_other = random_array({2, 1, 4, 2, 8}, rng), lse3 = zeros({3, 1, 2, 4});
    Frame lead({&q3, &k_other, &k_other}, {&o3, &lse3}, attributes(false, -1, -1, 0.5));
    CHECK(contains(run(&xla_attention_forward, lead), "leading axes do not match q's"));
    Frame batch({&q, &k_other, &k_other}, {&o, &lse}, attributes(false, -1, -1, 0.5));
    CHECK(contains(run(&xla_attention_forward, batch), "k has shape (2, 1, 4, 2, 8), whose "
                                                       "leading axes do not match q's"));

    Array q_big = random_array({1, 4, 2, 300}, rng), k_big = random_array({1, 4, 2, 300}, rng);
    Array o_big = zeros(q_big.dims);
    Frame core({&q_big, &k_big, &k_big}, {&o_big, &lse}, attributes(false, -1, -1, 0.5));
    CHECK(contains(run(&xla_attention_forward, core, &code), "head size D must be in 1..256"));
    CHECK(code == kInvalidArgument);

    Frame too_few({&q, &k}, {&o, &lse}, attributes(false, -1, -1, 0.5));
    CHECK(contains(run(&xla_attention_forward, too_few), "missing buffer v"));

    Array lse_wrong = zeros({1, 2, 5});
    Frame wrong_out({&q, &k, &v}, {&o, &lse_wrong}, attributes(false, -1, -1, 0.5));
    CHECK(contains(run(&xla_attention_forward, wrong_out), "lse has shape (1, 2, 5)"));
}

}  // namespace

int main() {
    test_metadata_query_is_answered();
    test_forward_and_backward_equal_the_cpu_engine();
    test_vmapped_leading_axes_fold_into_the_batch();
    test_sinks_under_lead_axes_run_once_per_index();
    test_bad_frames_are_errors_with_messages();
    return flashattn_test::finish("test_xla_handlers");
}
