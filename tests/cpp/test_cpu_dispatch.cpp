// The cpu engine's instruction-set dispatch: which paths are compiled and
// supported, how a request (FLASHATTN_CPU_ISA) is resolved or refused, and
// that the path in use is the one asked for, with its vector width.
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "cpu/isa.h"

using namespace flashattn;

namespace {

bool contains(const std::vector<std::string>& names, const std::string& n) {
    for (const auto& x : names)
        if (x == n) return true;
    return false;
}

int expected_width(const std::string& isa) {
    if (isa == "avx512") return 16;
    if (isa == "avx2") return 8;
    return 4;  // baseline, neon
}

}  // namespace

int main() {
    const auto compiled = cpu::compiled_isas();
    const auto supported = cpu::supported_isas();
    std::printf("compiled: ");
    for (const auto& n : compiled) std::printf("%s ", n.c_str());
    std::printf("\nsupported: ");
    for (const auto& n : supported) std::printf("%s ", n.c_str());
    std::printf("\n");

    CHECK(!compiled.empty());
    // The last compiled path (baseline, neon or native) runs everywhere.
    CHECK(!supported.empty() && supported.back() == compiled.back());
    // supported is compiled, filtered, in the same (best-first) order.
    size_t at = 0;
    for (const auto& n : compiled)
        if (at < supported.size() && supported[at] == n) ++at;
    CHECK(at == supported.size());

    // No request, or an empty one: the best supported path.
    CHECK(cpu::resolve_isa(nullptr) == supported.front());
    CHECK(cpu::resolve_isa("") == supported.front());
    for (const auto& n : supported) CHECK(cpu::resolve_isa(n.c_str()) == n);
    for (const auto& n : compiled)
        if (!contains(supported, n))
            CHECK_THROWS(std::runtime_error, "cannot run", cpu::resolve_isa(n.c_str()));
    CHECK_THROWS(std::invalid_argument, "FLASHATTN_CPU_ISA='sse9'", cpu::resolve_isa("sse9"));
    CHECK_THROWS(std::invalid_argument, "expected one of", cpu::resolve_isa("AVX2"));

#if defined(__x86_64__)
    // Every x86-64 CPU runs the baseline; the dispatched build has all three.
    if (!contains(compiled, "native")) {
        CHECK(compiled == (std::vector<std::string>{"avx512", "avx2", "baseline"}));
        CHECK(contains(supported, "baseline"));
        __builtin_cpu_init();
        CHECK(contains(supported, "avx2") ==
              (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")));
    }
#elif defined(__aarch64__)
    CHECK(compiled.front() == "neon" || compiled.front() == "native");
#endif

    // The path in use is the one the environment asks for.
    const char* env = std::getenv("FLASHATTN_CPU_ISA");
    try {
        const std::string want = cpu::resolve_isa(env);
        CHECK(cpu::active_isa() == want);
        if (want != "native") CHECK(cpu::active_vector_width() == expected_width(want));
        std::printf("active: %s (%d lanes)\n", cpu::active_isa().c_str(),
                    cpu::active_vector_width());
    } catch (const std::exception& e) {
        // A bad request makes active_isa throw the same error, every time.
        CHECK_THROWS(std::exception, e.what(), cpu::active_isa());
        CHECK_THROWS(std::exception, e.what(), cpu::active_isa());
    }
    return flashattn_test::finish("test_cpu_dispatch");
}
