// Which instruction-set path of the cpu engine runs: the kernels are
// compiled for several (avx512, avx2, baseline on x86-64; neon on arm64; or
// one "native" path when built with FLASHATTN_NATIVE=ON) and the best one the
// CPU supports is chosen at first use. FLASHATTN_CPU_ISA=<name> forces one.
#pragma once
#include <string>
#include <vector>

namespace flashattn::cpu {

// The paths compiled into this binary, best first.
std::vector<std::string> compiled_isas();

// The compiled paths this CPU (and its OS) can run, best first.
std::vector<std::string> supported_isas();

// The path a request names: the best supported one for nullptr or "", else
// `requested` itself. Throws std::invalid_argument for a name that is not a
// compiled path, std::runtime_error for one this CPU cannot run.
std::string resolve_isa(const char* requested);

// The path in use: resolve_isa(FLASHATTN_CPU_ISA), fixed at the first call
// that succeeds (a bad FLASHATTN_CPU_ISA makes every call throw).
std::string active_isa();

// Float lanes of the active path's vectors (16 for avx512, 8 avx2, 4 else).
int active_vector_width();

}  // namespace flashattn::cpu
