// flashattn._core: the arrays of a call become TensorViews, the core
// validates them into FlashParams, the chosen engine runs with the GIL
// released, and its output buffers go back to NumPy with their owners.
// Type and dtype checks happen in python/flashattn/_api.py, shape checks in
// the core (cpp/core/params.cpp): each in one place.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <set>
#include <string>

#include "bindings/released_call.h"
#include "core/engine.h"
#include "core/interrupt.h"
#include "core/params.h"
#include "core/registry.h"
#include "core/selftest.h"
#include "core/varlen.h"
#include "cpu/isa.h"
#include "engines/factories.h"
#include "sim/runtime.h"
#include "cpu/peak.h"
#include "cpu/thread_pool.h"
#include "sim/launcher.h"

namespace flashattn {
void bind_xla_handlers(nanobind::module_& m);  // cpp/bindings/xla_bindings.cpp (flashattn.jax)
void bind_instream(nanobind::module_& m);      // cpp/bindings/instream_bindings.cpp (issue 35)
}

#ifdef FLASHATTN_HAVE_METAL
namespace flashattn {
void bind_metal(nanobind::module_& m);  // cpp/bindings/metal_bindings.cpp
}
#endif

namespace nb = nanobind;
using namespace flashattn;

namespace {

using InputArray = nb::ndarray<const float, nb::device::cpu>;  // lse, the score options
// q, k, v, do, o: float32, or (float16, bfloat16) viewed as uint16 by
// python/flashattn/_api.py, with the call's dtype named by `dtype`.
using DataArray = nb::ndarray<nb::ro, nb::device::cpu>;
using MaskBytes = nb::ndarray<const uint8_t, nb::device::cpu>;  // a bool mask, viewed as bytes
using PrefixSums = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
// float32, or the raw uint16 bits of float16 / bfloat16 that _api views as such.
using OutputArray = nb::ndarray<nb::numpy>;

DType dtype_of(const char* fn, const std::string& name) {
    for (DType d : {DType::f32, DType::f16, DType::bf16})
        if (name == dtype_name(d)) return d;
    throw nb::type_error((std::string(fn) + ": dtype must be 'float32', 'float16' or 'bfloat16', "
                          "got '" + name + "'").c_str());
}

template <class Array>
TensorView view_of(const Array& a, DType dtype = DType::f32) {
    TensorView t;
    // A view carries a bool mask's bytes too; make_score_inputs hands them
    // on as the untyped pointer the kernels read as bytes.
    t.data = a.data();
    t.dtype = dtype;
    for (size_t i = 0; i < a.ndim(); ++i) {
        t.shape.push_back(int64_t(a.shape(i)));
        t.strides.push_back(int64_t(a.stride(i)));
    }
    return t;
}

// q, k, v, do or o as a view of `dtype`: float32 elements, or 16-bit ones.
TensorView data_view(const char* fn, const char* name, const DataArray& a, DType dtype) {
    const nb::dlpack::dtype want =
        dtype == DType::f32 ? nb::dtype<float>() : nb::dtype<uint16_t>();
    const nb::dlpack::dtype got = a.dtype();
    const bool half_ok = dtype != DType::f32 && got.bits == 16 && got.lanes == 1 &&
                         (got == want || got.code == uint8_t(nb::dlpack::dtype_code::Float));
    if (!(got == want) && !half_ok)
        throw nb::type_error((std::string(fn) + ": " + name + " must hold " + dtype_name(dtype) +
                              " elements").c_str());
    return view_of(a, dtype);
}

using bindings::run_released;

Engine& engine_for(const std::optional<std::string>& backend) {
    return backend ? get_engine(*backend) : default_engine();
}

// The RuntimeWarning for an engine left out after it started (its self-test
// failed, core/selftest.h), once per engine; the words are those of the
// import-time warning for an engine that could not start (_engines.py).
void warn_left_out(const std::string& engine, const std::string& reason) {
    static std::mutex mu;
    static std::set<std::string> warned;
    {
        std::lock_guard<std::mutex> lock(mu);
        if (!warned.insert(engine).second) return;
    }
    const std::string text = "flashattn engine unavailable, '" + engine +
                             "' left out of backends(). Reason: " + reason;
    if (PyErr_WarnEx(PyExc_RuntimeWarning, text.c_str(), 1) != 0) throw nb::python_error();
}

// Runs compute(engine) without the GIL. When the engine fails its self-test
// on this call it is left out from now on (Engine::unusable_reason) and a
// RuntimeWarning says why; the call is then answered by the best engine left
// when no backend was named, and raises the failure (RuntimeError) when this
// one was.
template <class F>
void run_on(const std::optional<std::string>& backend, Engine& engine, F&& compute) {
    try {
        run_released([&] { compute(engine); });
    } catch (const SelfTestFailed& e) {
        warn_left_out(engine.name(), e.what());
        if (backend) throw std::runtime_error(e.what());
        Engine& next = default_engine();
        run_released([&] { compute(next); });
    }
}

AttentionOptions options_of(bool causal, int64_t window_left, int64_t window_right,
                            std::optional<double> scale) {
    AttentionOptions opt;
    opt.causal = causal;
    opt.window_left = window_left;
    opt.window_right = window_right;
    opt.scale = scale;
    return opt;
}

// The score options as the core takes them: every array a view in place.
ScoreOptions score_options_of(double softcap, const std::optional<InputArray>& alibi,
                              const std::optional<MaskBytes>& mask_bool,
                              const std::optional<InputArray>& mask_float,
                              const std::optional<InputArray>& sinks) {
    ScoreOptions s;
    s.softcap = softcap;
    if (alibi) s.alibi_slopes = view_of(*alibi);
    if (mask_bool) s.mask = view_of(*mask_bool), s.mask_is_bool = true;
    if (mask_float) s.mask = view_of(*mask_float);
    if (sinks) s.sinks = view_of(*sinks);
    return s;
}

// An engine buffer of `shape`, to be filled while the GIL is released and
// then handed to NumPy; the capsule keeps the buffer's owner alive.
struct PendingOutput {
    OutputBuffer buffer;
    std::vector<size_t> shape;

    DType dtype;

    PendingOutput(Engine& engine, const char* fn, const char* name, std::vector<size_t> shape_,
                  DType dtype_ = DType::f32)
        : shape(std::move(shape_)), dtype(dtype_) {
        size_t n = 1;
        for (size_t s : shape) n *= s;
        const size_t size = dtype_size(dtype);
        try {
            if (n > SIZE_MAX / size) throw std::bad_alloc();
            buffer = engine.allocate(n * size);
        } catch (const std::bad_alloc&) {
            std::vector<int64_t> dims(shape.begin(), shape.end());
            PyErr_Format(PyExc_MemoryError,
                         "%s: cannot allocate the output %s of shape %s %s (%zu bytes) "
                         "for the %s engine",
                         fn, name, shape_string(dims).c_str(), dtype_name(dtype), n * size,
                         engine.name().c_str());
            throw nb::python_error();
        }
    }

    float* floats() const { return static_cast<float*>(buffer.data); }  // lse, dsinks

    OutputArray release() {
        auto* owner = new std::shared_ptr<void>(std::move(buffer.owner));
        nb::capsule capsule(owner, [](void* p) noexcept {
            delete static_cast<std::shared_ptr<void>*>(p);
        });
        return OutputArray(buffer.data, shape.size(), shape.data(), capsule, nullptr,
                           dtype == DType::f32 ? nb::dtype<float>() : nb::dtype<uint16_t>());
    }
};

nb::tuple forward(DataArray q, DataArray k, DataArray v, bool causal, int64_t window_left,
                  int64_t window_right, std::optional<double> scale, double softcap,
                  std::optional<InputArray> alibi, std::optional<MaskBytes> mask_bool,
                  std::optional<InputArray> mask_float, std::optional<InputArray> sinks,
                  std::optional<std::string> backend, const std::string& dtype_name_) {
    const char* fn = "attention";
    const DType dt = dtype_of(fn, dtype_name_);
    FlashParams p = make_forward_params(
        data_view(fn, "q", q, dt), data_view(fn, "k", k, dt), data_view(fn, "v", v, dt),
        options_of(causal, window_left, window_right, scale));
    const ScoreInputs score = make_score_inputs(
        fn, p, score_options_of(softcap, alibi, mask_bool, mask_float, sinks));
    Engine& engine = engine_for(backend);
    PendingOutput o(engine, fn, "o", {size_t(p.B), size_t(p.Tq), size_t(p.H), size_t(p.D)}, dt);
    PendingOutput lse(engine, fn, "lse", {size_t(p.B), size_t(p.H), size_t(p.Tq)});
    run_on(backend, engine, [&](Engine& e) {
        ForwardIO io{q.data(), k.data(), v.data(), o.buffer.data, lse.floats(), score};
        io.dtype = dt;
        run_forward(e, p, io);
    });
    return nb::make_tuple(o.release(), lse.release());
}

nb::tuple backward(DataArray dout, DataArray q, DataArray k, DataArray v, DataArray o,
                   InputArray lse, bool causal, int64_t window_left, int64_t window_right,
                   std::optional<double> scale, double softcap, std::optional<InputArray> alibi,
                   std::optional<MaskBytes> mask_bool, std::optional<InputArray> mask_float,
                   std::optional<InputArray> sinks, std::optional<std::string> backend,
                   const std::string& dtype_name_) {
    const char* fn = "attention_backward";
    const DType dt = dtype_of(fn, dtype_name_);
    FlashParams p = make_backward_params(
        data_view(fn, "do", dout, dt), data_view(fn, "q", q, dt), data_view(fn, "k", k, dt),
        data_view(fn, "v", v, dt), data_view(fn, "o", o, dt), view_of(lse),
        options_of(causal, window_left, window_right, scale));
    const ScoreInputs score = make_score_inputs(
        fn, p, score_options_of(softcap, alibi, mask_bool, mask_float, sinks));
    Engine& engine = engine_for(backend);
    PendingOutput dq(engine, fn, "dq", {size_t(p.B), size_t(p.Tq), size_t(p.H), size_t(p.D)}, dt);
    PendingOutput dk(engine, fn, "dk", {size_t(p.B), size_t(p.Tk), size_t(p.Hkv), size_t(p.D)},
                     dt);
    PendingOutput dv(engine, fn, "dv", {size_t(p.B), size_t(p.Tk), size_t(p.Hkv), size_t(p.D)},
                     dt);
    std::optional<PendingOutput> dsinks;
    if (sinks) dsinks.emplace(engine, fn, "dsinks", std::vector<size_t>{size_t(p.H)});
    run_on(backend, engine, [&](Engine& e) {
        BackwardIO io{dout.data(),    q.data(),       k.data(),      v.data(), o.data(),
                      lse.data(),     dq.buffer.data, dk.buffer.data, dv.buffer.data, score};
        io.dtype = dt;
        io.dsinks = dsinks ? dsinks->floats() : nullptr;
        run_backward(e, p, io);
    });
    if (dsinks)
        return nb::make_tuple(dq.release(), dk.release(), dv.release(), dsinks->release());
    return nb::make_tuple(dq.release(), dk.release(), dv.release());
}

Sequences sequences_of(const char* fn, const PrefixSums& cu_q, const PrefixSums& cu_k,
                       const DataArray& q, const DataArray& k) {
    if (q.ndim() != 3 || k.ndim() != 3)
        throw std::invalid_argument(std::string(fn) + ": q and k must have 3 dimensions "
                                    "(total, heads, D)");
    return make_sequences(fn, cu_q.data(), int64_t(cu_q.shape(0)), cu_k.data(),
                          int64_t(cu_k.shape(0)), int64_t(q.shape(0)), int64_t(k.shape(0)));
}

// per_sequence (private: the bench's and tests' baseline): one engine call
// per sequence instead of the engine's one call for the batch.
VarlenSchedule schedule_of(bool per_sequence) {
    return per_sequence ? VarlenSchedule::per_sequence : VarlenSchedule::one_call;
}

nb::tuple forward_varlen(DataArray q, DataArray k, DataArray v, PrefixSums cu_q,
                         PrefixSums cu_k, bool causal, int64_t window_left, int64_t window_right,
                         std::optional<double> scale, double softcap,
                         std::optional<InputArray> alibi, std::optional<InputArray> sinks,
                         std::optional<std::string> backend, const std::string& dtype_name_,
                         bool per_sequence) {
    const char* fn = "attention_varlen";
    const DType dt = dtype_of(fn, dtype_name_);
    const Sequences seqs = sequences_of(fn, cu_q, cu_k, q, k);
    const TensorView qv = data_view(fn, "q", q, dt), kv = data_view(fn, "k", k, dt),
                     vv = data_view(fn, "v", v, dt);
    Engine& engine = engine_for(backend);
    const size_t total = q.shape(0), H = q.shape(1), D = q.shape(2);
    PendingOutput o(engine, fn, "o", {total, H, D}, dt);
    PendingOutput lse(engine, fn, "lse", {H, total});
    const ScoreOptions score = score_options_of(softcap, alibi, std::nullopt, std::nullopt, sinks);
    run_on(backend, engine, [&](Engine& e) {
        run_forward_varlen(e, seqs, qv, kv, vv,
                           options_of(causal, window_left, window_right, scale), score,
                           o.buffer.data, lse.floats(), schedule_of(per_sequence));
    });
    return nb::make_tuple(o.release(), lse.release());
}

nb::tuple backward_varlen(DataArray dout, DataArray q, DataArray k, DataArray v,
                          DataArray o, nb::ndarray<const float, nb::ndim<2>, nb::c_contig,
                                                  nb::device::cpu> lse,
                          PrefixSums cu_q, PrefixSums cu_k, bool causal, int64_t window_left,
                          int64_t window_right, std::optional<double> scale, double softcap,
                          std::optional<InputArray> alibi, std::optional<InputArray> sinks,
                          std::optional<std::string> backend, const std::string& dtype_name_,
                          bool per_sequence) {
    const char* fn = "attention_varlen_backward";
    const DType dt = dtype_of(fn, dtype_name_);
    const Sequences seqs = sequences_of(fn, cu_q, cu_k, q, k);
    if (lse.shape(0) != q.shape(1) || lse.shape(1) != q.shape(0))
        throw std::invalid_argument(std::string(fn) + ": lse must have shape (H, total_q) = (" +
                                    std::to_string(q.shape(1)) + ", " +
                                    std::to_string(q.shape(0)) + ")");
    Engine& engine = engine_for(backend);
    auto shape_of = [](const DataArray& a) {
        return std::vector<size_t>{a.shape(0), a.shape(1), a.shape(2)};
    };
    PendingOutput dq(engine, fn, "dq", shape_of(q), dt);
    PendingOutput dk(engine, fn, "dk", shape_of(k), dt);
    PendingOutput dv(engine, fn, "dv", shape_of(k), dt);
    if (v.ndim() != 3 || v.shape(0) != k.shape(0) || v.shape(1) != k.shape(1) ||
        v.shape(2) != k.shape(2))
        throw std::invalid_argument(std::string(fn) + ": k and v must have the same shape");
    const TensorView views[] = {data_view(fn, "do", dout, dt), data_view(fn, "q", q, dt),
                                data_view(fn, "k", k, dt), data_view(fn, "v", v, dt),
                                data_view(fn, "o", o, dt)};
    std::optional<PendingOutput> dsinks;
    if (sinks) dsinks.emplace(engine, fn, "dsinks", std::vector<size_t>{size_t(q.shape(1))});
    const ScoreOptions score = score_options_of(softcap, alibi, std::nullopt, std::nullopt, sinks);
    run_on(backend, engine, [&](Engine& e) {
        run_backward_varlen(e, seqs, views[0], views[1], views[2], views[3], views[4],
                            lse.data(), options_of(causal, window_left, window_right, scale),
                            score, dq.buffer.data, dk.buffer.data, dv.buffer.data,
                            dsinks ? dsinks->floats() : nullptr, schedule_of(per_sequence));
    });
    if (dsinks)
        return nb::make_tuple(dq.release(), dk.release(), dv.release(), dsinks->release());
    return nb::make_tuple(dq.release(), dk.release(), dv.release());
}

// fa.reference's shape and option checks: the core's, on shapes alone.
void check_call(const std::string& fn, const std::vector<int64_t>& q_shape,
                const std::vector<int64_t>& k_shape, const std::vector<int64_t>& v_shape,
                bool causal, int64_t window_left, int64_t window_right,
                std::optional<double> scale) {
    check_call_shapes(fn, q_shape, k_shape, v_shape,
                      options_of(causal, window_left, window_right, scale));
}

}  // namespace

NB_MODULE(_core, m) {
    m.doc() = "flashattn's compiled core; use the flashattn package, not this module.";
    m.def("backends", &available_engines, "Engines usable on this machine, best first.");
    // Engines left out here, with why (python/flashattn/_engines.py; issue 11).
    m.def("_engines_missing", [] {
        nb::list out;
        for (const MissingEngine& e : missing_engines())
            out.append(nb::make_tuple(e.name, e.reason, e.failed));
        return out;
    });
    // The self-test (core/selftest.h) of an engine that runs one: what it has
    // checked and what that cost; None for an engine without it.
    m.def("_selftest_stats", [](const std::string& name) -> nb::object {
        for (const std::string& engine : available_engines())
            if (engine == name) {
                const SelfTest* t = get_engine(name).selftest();
                if (!t) return nb::none();
                const SelfTest::Stats st = t->stats();
                nb::dict d;
                d["pipelines"] = st.pipelines;
                d["probes"] = st.probes;
                d["seconds"] = st.seconds;
                return d;
            }
        return nb::none();
    }, nb::arg("backend"));
    // metal-sim's lane probe, and the planted lane fault of the self-test's tests.
    m.def("_sim_lane_probe", [] {
        std::string error;
        run_released([&] { error = sim_lane_probe(); });
        return error;
    });
    m.def("_sim_set_lane_fault", [](bool on) { fa_sim::set_lane_map_fault(on); }, nb::arg("on"));
    // The dtypes an engine's kernels take (tests parametrise by them).
    m.def("_engine_dtypes", [](const std::string& name) {
        std::vector<std::string> out;
        Engine& engine = get_engine(name);
        for (DType d : {DType::f32, DType::f16, DType::bf16})
            if (engine.dtype_supported(d)) out.emplace_back(dtype_name(d));
        return out;
    }, nb::arg("backend"));
    m.def("forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("causal"),
          nb::arg("window_left"), nb::arg("window_right"), nb::arg("scale").none(),
          nb::arg("softcap") = 0.0, nb::arg("alibi_slopes").none() = nb::none(),
          nb::arg("mask_bool").none() = nb::none(), nb::arg("mask_float").none() = nb::none(),
          nb::arg("sinks").none() = nb::none(), nb::arg("backend").none() = nb::none(),
          nb::arg("dtype") = "float32");
    m.def("backward", &backward, nb::arg("do"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
          nb::arg("o"), nb::arg("lse"), nb::arg("causal"), nb::arg("window_left"),
          nb::arg("window_right"), nb::arg("scale").none(), nb::arg("softcap") = 0.0,
          nb::arg("alibi_slopes").none() = nb::none(), nb::arg("mask_bool").none() = nb::none(),
          nb::arg("mask_float").none() = nb::none(), nb::arg("sinks").none() = nb::none(),
          nb::arg("backend").none() = nb::none(), nb::arg("dtype") = "float32");
    m.def("forward_varlen", &forward_varlen, nb::arg("q"), nb::arg("k"), nb::arg("v"),
          nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("causal"),
          nb::arg("window_left"), nb::arg("window_right"), nb::arg("scale").none(),
          nb::arg("softcap"), nb::arg("alibi_slopes").none(), nb::arg("sinks").none(),
          nb::arg("backend").none(), nb::arg("dtype") = "float32",
          nb::arg("_per_sequence") = false);
    m.def("backward_varlen", &backward_varlen, nb::arg("do"), nb::arg("q"), nb::arg("k"),
          nb::arg("v"), nb::arg("o"), nb::arg("lse"), nb::arg("cu_seqlens_q"),
          nb::arg("cu_seqlens_k"), nb::arg("causal"), nb::arg("window_left"),
          nb::arg("window_right"), nb::arg("scale").none(), nb::arg("softcap"),
          nb::arg("alibi_slopes").none(), nb::arg("sinks").none(), nb::arg("backend").none(),
          nb::arg("dtype") = "float32", nb::arg("_per_sequence") = false);
    m.def("check_call", &check_call, nb::arg("fn"), nb::arg("q_shape"), nb::arg("k_shape"),
          nb::arg("v_shape"), nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
          nb::arg("scale").none());
    // Waits for running cpu calls: without the GIL, so other threads go on.
    m.def("set_num_threads", [](int n) { run_released([&] { cpu::set_num_threads(n); }); },
          nb::arg("n"));
    m.def("get_num_threads", &cpu::num_threads);
    // For the benchmark (python -m flashattn bench): GFLOP/s of FMA chains.
    m.def("_cpu_fma_peak", &cpu::measure_fma_peak, nb::arg("seconds"), nb::arg("threads"),
          nb::call_guard<nb::gil_scoped_release>());
    // GB/s read from a buffer beyond the caches: a decoding step's limit.
    m.def("_cpu_read_bandwidth", &cpu::measure_read_bandwidth, nb::arg("seconds"),
          nb::arg("threads"), nb::arg("bytes") = size_t(512) << 20,
          nb::call_guard<nb::gil_scoped_release>());
    // Microseconds per parallel_for of empty tasks: the pool's wake-up cost.
    m.def("_cpu_pool_wakeup_us", &cpu::pool_wakeup_us, nb::arg("calls"),
          nb::call_guard<nb::gil_scoped_release>());
    // metal-sim's operation counts (sim/launcher.h): the cost model of
    // docs/metal.md (bench/metal_model.py) is checked against them.
    // _sim_op_counts(): the totals; _sim_op_counts(True): per kernel host name.
    m.def(
        "_sim_op_counts",
        [](bool by_kernel) -> nb::object {
            auto as_dict = [](const sim::OpCounts& c) {
                nb::dict d;
                d["mma"] = c.mma;
                d["matrix_loads"] = c.matrix_loads;
                d["matrix_stores"] = c.matrix_stores;
                d["simd_exchanges"] = c.simd_exchanges;
                d["barriers"] = c.barriers;
                return d;
            };
            if (!by_kernel) return as_dict(sim::op_counts());
            nb::dict all;
            for (const auto& [name, c] : sim::op_counts_by_kernel()) all[name.c_str()] = as_dict(c);
            return all;
        },
        nb::arg("by_kernel") = false);
    m.def("_sim_reset_op_counts", &sim::reset_op_counts);
    // The pool's record of its calls (FLASHATTN_CPU_PROFILE=1): per call
    // [tasks, threads, wall s, busy s summed over threads, longest task s].
    m.def("_cpu_pool_profile", [] {
        std::vector<std::vector<double>> rows;
        for (const cpu::PoolCallProfile& c : cpu::take_pool_profile())
            rows.push_back({double(c.tasks), double(c.threads), c.wall_s, c.busy_s, c.longest_s});
        return rows;
    });
    bind_xla_handlers(m);
    bind_instream(m);
    // The cpu engine's instruction-set paths (cpp/cpu/isa.h; issue 13).
    m.def("cpu_isa", &cpu::active_isa, "The cpu engine's instruction-set path in use.");
    m.def("cpu_isas_supported", &cpu::supported_isas, "Paths this CPU runs, best first.");
    m.def("cpu_isas_compiled", &cpu::compiled_isas, "Paths built in, best first.");
#ifdef FLASHATTN_HAVE_METAL
    bind_metal(m);
#endif
    bindings::install_process_hooks(m);  // the exit hook and the fork handler
}
