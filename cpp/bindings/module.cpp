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
#include <string>

#include "core/engine.h"
#include "core/params.h"
#include "core/registry.h"
#include "cpu/isa.h"
#include "cpu/peak.h"
#include "cpu/thread_pool.h"

#ifdef FLASHATTN_HAVE_METAL
namespace flashattn {
void bind_metal(nanobind::module_& m);  // cpp/bindings/metal_bindings.cpp
}
#endif

namespace nb = nanobind;
using namespace flashattn;

namespace {

using InputArray = nb::ndarray<const float, nb::device::cpu>;
using OutputArray = nb::ndarray<nb::numpy, float>;

TensorView view_of(const InputArray& a) {
    TensorView t;
    t.data = a.data();
    for (size_t i = 0; i < a.ndim(); ++i) {
        t.shape.push_back(int64_t(a.shape(i)));
        t.strides.push_back(int64_t(a.stride(i)));
    }
    return t;
}

Engine& engine_for(const std::optional<std::string>& backend) {
    return backend ? get_engine(*backend) : default_engine();
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

// An engine buffer of `shape`, to be filled while the GIL is released and
// then handed to NumPy; the capsule keeps the buffer's owner alive.
struct PendingOutput {
    OutputBuffer buffer;
    std::vector<size_t> shape;

    PendingOutput(Engine& engine, std::vector<size_t> shape_) : shape(std::move(shape_)) {
        size_t n = 1;
        for (size_t s : shape) n *= s;
        buffer = engine.allocate(n);
    }

    OutputArray release() {
        auto* owner = new std::shared_ptr<void>(std::move(buffer.owner));
        nb::capsule capsule(owner, [](void* p) noexcept {
            delete static_cast<std::shared_ptr<void>*>(p);
        });
        return OutputArray(buffer.data, shape.size(), shape.data(), capsule);
    }
};

nb::tuple forward(InputArray q, InputArray k, InputArray v, bool causal, int64_t window_left,
                  int64_t window_right, std::optional<double> scale,
                  std::optional<std::string> backend) {
    const FlashParams p = make_forward_params(view_of(q), view_of(k), view_of(v),
                                              options_of(causal, window_left, window_right, scale));
    Engine& engine = engine_for(backend);
    PendingOutput o(engine, {size_t(p.B), size_t(p.Tq), size_t(p.H), size_t(p.D)});
    PendingOutput lse(engine, {size_t(p.B), size_t(p.H), size_t(p.Tq)});
    {
        nb::gil_scoped_release released;
        run_forward(engine, p, {q.data(), k.data(), v.data(), o.buffer.data, lse.buffer.data});
    }
    return nb::make_tuple(o.release(), lse.release());
}

nb::tuple backward(InputArray dout, InputArray q, InputArray k, InputArray v, InputArray o,
                   InputArray lse, bool causal, int64_t window_left, int64_t window_right,
                   std::optional<double> scale, std::optional<std::string> backend) {
    const FlashParams p = make_backward_params(
        view_of(dout), view_of(q), view_of(k), view_of(v), view_of(o), view_of(lse),
        options_of(causal, window_left, window_right, scale));
    Engine& engine = engine_for(backend);
    PendingOutput dq(engine, {size_t(p.B), size_t(p.Tq), size_t(p.H), size_t(p.D)});
    PendingOutput dk(engine, {size_t(p.B), size_t(p.Tk), size_t(p.Hkv), size_t(p.D)});
    PendingOutput dv(engine, {size_t(p.B), size_t(p.Tk), size_t(p.Hkv), size_t(p.D)});
    {
        nb::gil_scoped_release released;
        run_backward(engine, p,
                     {dout.data(), q.data(), k.data(), v.data(), o.data(), lse.data(),
                      dq.buffer.data, dk.buffer.data, dv.buffer.data});
    }
    return nb::make_tuple(dq.release(), dk.release(), dv.release());
}

}  // namespace

NB_MODULE(_core, m) {
    m.doc() = "flashattn's compiled core; use the flashattn package, not this module.";
    m.def("backends", &available_engines, "Engines usable on this machine, best first.");
    m.def("forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("causal"),
          nb::arg("window_left"), nb::arg("window_right"), nb::arg("scale").none(),
          nb::arg("backend").none());
    m.def("backward", &backward, nb::arg("do"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
          nb::arg("o"), nb::arg("lse"), nb::arg("causal"), nb::arg("window_left"),
          nb::arg("window_right"), nb::arg("scale").none(), nb::arg("backend").none());
    m.def("set_num_threads", &cpu::set_num_threads, nb::arg("n"));
    m.def("get_num_threads", &cpu::num_threads);
    // For the benchmark (python -m flashattn bench): GFLOP/s of FMA chains.
    m.def("_cpu_fma_peak", &cpu::measure_fma_peak, nb::arg("seconds"), nb::arg("threads"),
          nb::call_guard<nb::gil_scoped_release>());
    // The cpu engine's instruction-set paths (cpp/cpu/isa.h; issue 13).
    m.def("cpu_isa", &cpu::active_isa, "The cpu engine's instruction-set path in use.");
    m.def("cpu_isas_supported", &cpu::supported_isas, "Paths this CPU runs, best first.");
    m.def("cpu_isas_compiled", &cpu::compiled_isas, "Paths built in, best first.");
#ifdef FLASHATTN_HAVE_METAL
    bind_metal(m);
#endif
}
