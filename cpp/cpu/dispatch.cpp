// Runtime dispatch of the cpu engine: the table of per-ISA kernel copies
// built into this binary (FLASHATTN_CPU_HAVE_<ISA>, set by CMakeLists.txt),
// the CPU feature test for each, and the choice made at first use. The
// engine's entry points (attention.h, peak.h) forward to the chosen copy.
#include "cpu/isa.h"

#include <cstdlib>
#include <stdexcept>

#include "cpu/attention.h"
#include "cpu/call_phases.h"
#include "cpu/kernels.h"
#include "cpu/peak.h"

#if defined(FLASHATTN_CPU_HAVE_AVX512)
FLASHATTN_CPU_KERNELS(avx512)
#endif
#if defined(FLASHATTN_CPU_HAVE_AVX2)
FLASHATTN_CPU_KERNELS(avx2)
#endif
#if defined(FLASHATTN_CPU_HAVE_BASELINE)
FLASHATTN_CPU_KERNELS(baseline)
#endif
#if defined(FLASHATTN_CPU_HAVE_NEON)
FLASHATTN_CPU_KERNELS(neon)
#endif
#if defined(FLASHATTN_CPU_HAVE_NATIVE)
FLASHATTN_CPU_KERNELS(native)
#endif

namespace flashattn::cpu {
namespace {

struct Path {
    const char* name;
    bool (*runs_here)();
    void (*forward)(const FlashParams&, const ForwardIO&);
    void (*backward)(const FlashParams&, const BackwardIO&);
    std::unique_ptr<CallPhases> (*forward_phases)(const FlashParams&, const ForwardIO&, Sharing);
    std::unique_ptr<CallPhases> (*backward_phases)(const FlashParams&, const BackwardIO&, Sharing);
    double (*fma_peak)(double, int);
    int (*vector_width)();
};

bool always() { return true; }

#if defined(__x86_64__) || defined(__i386__)
// __builtin_cpu_supports also asks the OS (xgetbv) whether it saves the
// AVX and AVX-512 registers, so a feature the kernel disabled counts as absent.
// The lists match the target pragmas of cpu/isa_begin.h.
bool has_avx2() {
    __builtin_cpu_init();
    // F16C (float16 loads) came with AVX2 on every x86-64 CPU that has it.
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}
bool has_avx512() {
    __builtin_cpu_init();
    return has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}
#endif

#define FLASHATTN_PATH(isa, test)                                                      \
    Path {                                                                             \
        #isa, test, isa::attention_forward, isa::attention_backward,                   \
            isa::forward_phases, isa::backward_phases,                                 \
            isa::measure_fma_peak, isa::vector_width                                   \
    }

// Best first.
const Path kPaths[] = {
#if defined(FLASHATTN_CPU_HAVE_NATIVE)
    FLASHATTN_PATH(native, always),
#endif
#if defined(FLASHATTN_CPU_HAVE_AVX512)
    FLASHATTN_PATH(avx512, has_avx512),
#endif
#if defined(FLASHATTN_CPU_HAVE_AVX2)
    FLASHATTN_PATH(avx2, has_avx2),
#endif
#if defined(FLASHATTN_CPU_HAVE_NEON)
    FLASHATTN_PATH(neon, always),
#endif
#if defined(FLASHATTN_CPU_HAVE_BASELINE)
    FLASHATTN_PATH(baseline, always),
#endif
};

std::string join(const std::vector<std::string>& names) {
    std::string s;
    for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
    return s;
}

const Path& find_path(const char* requested) {
    const std::string want = requested ? requested : "";
    if (want.empty()) {
        for (const Path& p : kPaths)
            if (p.runs_here()) return p;
        throw std::runtime_error("cpu engine: this CPU runs none of the compiled paths (" +
                                 join(compiled_isas()) + ")");
    }
    for (const Path& p : kPaths) {
        if (want != p.name) continue;
        if (!p.runs_here())
            throw std::runtime_error("FLASHATTN_CPU_ISA='" + want +
                                     "': this CPU cannot run it; it can run: " +
                                     join(supported_isas()));
        return p;
    }
    throw std::invalid_argument("FLASHATTN_CPU_ISA='" + want +
                                "' is not a path of this build; expected one of: " +
                                join(compiled_isas()));
}

const Path& active() {
    static const Path& path = find_path(std::getenv("FLASHATTN_CPU_ISA"));
    return path;
}

}  // namespace

std::vector<std::string> compiled_isas() {
    std::vector<std::string> names;
    for (const Path& p : kPaths) names.emplace_back(p.name);
    return names;
}

std::vector<std::string> supported_isas() {
    std::vector<std::string> names;
    for (const Path& p : kPaths)
        if (p.runs_here()) names.emplace_back(p.name);
    return names;
}

std::string resolve_isa(const char* requested) { return find_path(requested).name; }
std::string active_isa() { return active().name; }
int active_vector_width() { return active().vector_width(); }

void attention_forward(const FlashParams& p, const ForwardIO& io) { active().forward(p, io); }
void attention_backward(const FlashParams& p, const BackwardIO& io) {
    active().backward(p, io);
}
std::unique_ptr<CallPhases> forward_phases(const FlashParams& p, const ForwardIO& io,
                                           Sharing sharing) {
    return active().forward_phases(p, io, sharing);
}
std::unique_ptr<CallPhases> backward_phases(const FlashParams& p, const BackwardIO& io,
                                            Sharing sharing) {
    return active().backward_phases(p, io, sharing);
}
double measure_fma_peak(double seconds, int threads) {
    return active().fma_peak(seconds, threads);
}

}  // namespace flashattn::cpu
