// What every engine shares: default output memory, and the degenerate calls
// (no rows, no keys) answered once here instead of in each engine.
#include "core/engine.h"

#include <algorithm>
#include <cstdlib>
#include <limits>

#include "core/host_memory.h"
#include "core/params.h"

namespace flashattn {

OutputBuffer Engine::allocate(size_t n_floats) {
    void* data = allocate_host(n_floats * sizeof(float));
    return {static_cast<float*>(data), std::shared_ptr<void>(data, std::free)};
}

void run_forward(Engine& engine, const FlashParams& p, const ForwardIO& io) {
    if (q_elements(p) == 0) return;
    if (p.Tk == 0) {  // every row sees no key
        std::fill_n(io.o, q_elements(p), 0.0f);
        std::fill_n(io.lse, lse_elements(p), -std::numeric_limits<float>::infinity());
        return;
    }
    engine.forward(p, io);
}

void run_backward(Engine& engine, const FlashParams& p, const BackwardIO& io) {
    if (q_elements(p) == 0 || p.Tk == 0) {  // no (query, key) pair: every gradient is zero
        std::fill_n(io.dq, q_elements(p), 0.0f);
        std::fill_n(io.dk, kv_elements(p), 0.0f);
        std::fill_n(io.dv, kv_elements(p), 0.0f);
        return;
    }
    engine.backward(p, io);
}

}  // namespace flashattn
