// flashattn._core's side of the in-stream paths (python/flashattn/_instream):
// _plan_call gives a call's plan and schedule, the metal engine's own
// (core/call_plan.h), so that Python derives nothing; _sim_instream_* run
// the generated kernel texts that metal-sim compiled (sim/instream.h), for
// the stand-ins of MLX's metal_kernel and torch's compile_shader.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "core/call_plan.h"
#include "sim/instream.h"

namespace nb = nanobind;

namespace flashattn {
namespace {

// An array as the planner sees it: shape and element strides (no data).
using Layout = std::tuple<std::vector<int64_t>, std::vector<int64_t>>;

TensorView view(const Layout& layout, DType dtype) {
    TensorView t;
    t.shape = std::get<0>(layout);
    t.strides = std::get<1>(layout);
    t.dtype = dtype;
    if (t.strides.size() != t.shape.size())
        throw std::invalid_argument("_plan_call: a layout needs one stride per axis");
    return t;
}

DType dtype_named(const std::string& name) {
    for (DType d : {DType::f32, DType::f16, DType::bf16})
        if (name == dtype_name(d)) return d;
    throw std::invalid_argument("_plan_call: dtype must be 'float32', 'float16' or 'bfloat16', "
                                "got '" + name + "'");
}

const char* constant_type(FunctionConstant::Type t) {
    switch (t) {
        case FunctionConstant::Type::boolean: return "boolean";
        case FunctionConstant::Type::int32: return "int32";
        case FunctionConstant::Type::float32: return "float32";
    }
    return "?";
}

nb::tuple dim3(const Dim3& d) { return nb::make_tuple(d.x, d.y, d.z); }

template <class T>
nb::bytes bytes_of(const T& value) {
    return nb::bytes(reinterpret_cast<const char*>(&value), sizeof(T));
}

nb::dict describe(const CallPlan& call) {
    nb::dict out;
    const FlashParams& p = call.params;
    out["empty"] = call.empty;
    out["B"] = p.B, out["Tq"] = p.Tq, out["Tk"] = p.Tk, out["H"] = p.H, out["Hkv"] = p.Hkv;
    out["D"] = p.D;
    out["params"] = bytes_of(call.params);
    out["score"] = bytes_of(call.plan.score);
    nb::list launches;
    for (const Launch& l : call.plan.launches) {
        nb::dict d;
        d["kernel"] = l.kernel;
        nb::list buffers;
        for (Slot s : l.buffers) buffers.append(slot_name(s));
        d["buffers"] = buffers;
        d["grid"] = dim3(l.grid);
        d["threadgroup"] = dim3(l.threadgroup);
        nb::list constants;
        for (const FunctionConstant& c : l.constants)
            constants.append(nb::make_tuple(c.index, constant_type(c.type), c.bits));
        d["constants"] = constants;
        launches.append(d);
    }
    out["launches"] = launches;
    nb::list scratch;
    for (const Scratch& s : call.plan.scratch) scratch.append(nb::make_tuple(slot_name(s.slot), s.floats));
    out["scratch"] = scratch;
    nb::list pieces;
    for (const Piece& piece : call.schedule.pieces)
        pieces.append(nb::make_tuple(piece.launch, dim3(piece.origin), dim3(piece.grid),
                                     bytes_of(params_for_piece(call.plan.params, piece))));
    out["pieces"] = pieces;
    nb::list buffers;
    for (size_t first : call.schedule.command_buffers) buffers.append(first);
    out["command_buffers"] = buffers;
    return out;
}

ScoreOptions score_options(double softcap, const std::optional<Layout>& alibi,
                           const std::optional<Layout>& mask, bool mask_bool,
                           const std::optional<Layout>& sinks) {
    ScoreOptions s;
    s.softcap = softcap;
    if (alibi) s.alibi_slopes = view(*alibi, DType::f32);
    if (mask) s.mask = view(*mask, DType::f32), s.mask_is_bool = mask_bool;
    if (sinks) s.sinks = view(*sinks, DType::f32);
    return s;
}

AttentionOptions attention_options(bool causal, int64_t left, int64_t right,
                                   std::optional<double> scale) {
    AttentionOptions o;
    o.causal = causal, o.window_left = left, o.window_right = right, o.scale = scale;
    return o;
}

nb::dict plan_call(const std::string& direction, const std::string& dtype, const Layout& q,
                   const Layout& k, const Layout& v, const std::optional<Layout>& dout,
                   const std::optional<Layout>& o, const std::optional<Layout>& lse, bool causal,
                   int64_t window_left, int64_t window_right, std::optional<double> scale,
                   double softcap, const std::optional<Layout>& alibi,
                   const std::optional<Layout>& mask, bool mask_bool,
                   const std::optional<Layout>& sinks, std::optional<int> gpu_cores) {
    const DType dt = dtype_named(dtype);
    GpuInfo gpu;
    if (gpu_cores) {
        if (*gpu_cores < 1)
            throw std::invalid_argument("_plan_call: gpu_cores must be at least 1, got " +
                                        std::to_string(*gpu_cores));
        gpu.cores = *gpu_cores;
    }
    const AttentionOptions opt = attention_options(causal, window_left, window_right, scale);
    const ScoreOptions score = score_options(softcap, alibi, mask, mask_bool, sinks);
    if (direction == "forward")
        return describe(plan_call_forward(view(q, dt), view(k, dt), view(v, dt), opt, score, dt, gpu));
    if (direction != "backward")
        throw std::invalid_argument("_plan_call: direction must be 'forward' or 'backward'");
    if (!dout || !o || !lse)
        throw std::invalid_argument("_plan_call: the backward needs do, o and lse");
    return describe(plan_call_backward(view(*dout, dt), view(q, dt), view(k, dt), view(v, dt),
                                       view(*o, dt), view(*lse, DType::f32), opt, score, dt));
}

const sim::Kernel& instream_kernel(const std::string& key) {
    for (const sim::Kernel& k : sim::instream_kernels())
        if (k.name == key) return k;
    throw std::runtime_error("metal-sim has no compiled copy of the generated kernel text " + key +
                             " (the texts are generated at build time from the same shaders: "
                             "rebuild after changing them or the generator)");
}

// Runs a generated kernel text on metal-sim: `buffers` in its argument
// order, each an array (bound in place), an address (an int: a torch
// tensor's data_ptr()) or bytes (a struct by value).
void sim_instream_run(const std::string& key, nb::list buffers, std::tuple<uint32_t, uint32_t, uint32_t> grid,
                      std::tuple<uint32_t, uint32_t, uint32_t> group,
                      const std::vector<std::tuple<uint32_t, std::string, uint32_t>>& constants) {
    const sim::Kernel& kernel = instream_kernel(key);
    std::vector<sim::Binding> bindings;
    std::vector<std::string> values;  // by-value structs, alive for the launch
    values.reserve(buffers.size());
    for (nb::handle item : buffers) {
        if (nb::isinstance<nb::bytes>(item)) {
            nb::bytes b = nb::borrow<nb::bytes>(item);
            values.emplace_back(b.c_str(), b.size());
            bindings.push_back({values.back().data(), true});
        } else if (nb::isinstance<nb::int_>(item)) {
            bindings.push_back({reinterpret_cast<void*>(nb::cast<uintptr_t>(item)), false});
        } else {
            nb::ndarray<nb::device::cpu> a = nb::cast<nb::ndarray<nb::device::cpu>>(item);
            bindings.push_back({a.data(), false});
        }
    }
    std::vector<FunctionConstant> fc;
    for (const auto& [index, type, bits] : constants) {
        FunctionConstant c;
        c.index = uint16_t(index);
        c.bits = bits;
        if (type == "boolean") c.type = FunctionConstant::Type::boolean;
        else if (type == "int32") c.type = FunctionConstant::Type::int32;
        else if (type == "float32") c.type = FunctionConstant::Type::float32;
        else throw std::invalid_argument("_sim_instream_run: unknown constant type " + type);
        fc.push_back(c);
    }
    const Dim3 g{std::get<0>(grid), std::get<1>(grid), std::get<2>(grid)};
    const Dim3 t{std::get<0>(group), std::get<1>(group), std::get<2>(group)};
    nb::gil_scoped_release release;  // the arrays stay alive: the caller holds them
    sim::run_launch(kernel, bindings, g, t, fc);
}

}  // namespace

void bind_instream(nb::module_& m) {
    m.def("_plan_call", &plan_call, nb::arg("direction"), nb::arg("dtype"), nb::arg("q"),
          nb::arg("k"), nb::arg("v"), nb::arg("do").none() = nb::none(),
          nb::arg("o").none() = nb::none(), nb::arg("lse").none() = nb::none(),
          nb::arg("causal") = false, nb::arg("window_left") = -1, nb::arg("window_right") = -1,
          nb::arg("scale").none() = nb::none(), nb::arg("softcap") = 0.0,
          nb::arg("alibi").none() = nb::none(), nb::arg("mask").none() = nb::none(),
          nb::arg("mask_bool") = false, nb::arg("sinks").none() = nb::none(),
          nb::arg("gpu_cores").none() = nb::none(),
          "A call's plan and schedule of pieces, as the metal engine makes them "
          "(core/call_plan.h); the arrays as (shape, strides in elements); "
          "gpu_cores: the GPU's core count (default: core/plan.h's GpuInfo, an 8-core M1).");
    m.def("_sim_kernel_names", [] {
        std::vector<std::string> names;
        for (const sim::Kernel& k : sim::kernels()) names.push_back(k.name);
        return names;
    }, "The kernels metal-sim compiled from shaders/*.metal, by host name.");
    m.def("_sim_instream_keys", [] {
        std::vector<std::string> keys;
        for (const sim::Kernel& k : sim::instream_kernels()) keys.push_back(k.name);
        return keys;
    }, "Keys of the generated kernel texts metal-sim compiled.");
    m.def("_sim_instream_run", &sim_instream_run, nb::arg("key"), nb::arg("buffers"),
          nb::arg("grid"), nb::arg("threadgroup"), nb::arg("constants"),
          "Runs a generated kernel text on metal-sim (grid in threadgroups).");
}

}  // namespace flashattn
