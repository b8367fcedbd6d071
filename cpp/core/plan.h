// A call turned into GPU work: the list of kernel launches, in order, with
// their grids and buffer bindings. Platform-free; the metal host and the
// metal-sim launcher execute the same Plan, so the simulator tests the
// dispatch logic that ships.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "flash_params.h"

namespace flashattn {

// What a kernel's [[buffer(n)]] argument is bound to.
enum class Slot : uint8_t {
    q, k, v, o, lse,           // forward inputs / outputs
    dout, dq, dk, dv,          // backward
    delta,                     // scratch: D = rowsum(dout * o), (B, H, Tq) floats
    params,                    // the FlashParams struct, by value (setBytes)
};

const char* slot_name(Slot s);

struct Dim3 {
    uint32_t x = 1, y = 1, z = 1;
};

struct Launch {
    std::string kernel;          // Metal function name, spelling its specialisation
    std::vector<Slot> buffers;   // buffers[n] is bound to [[buffer(n)]]
    Dim3 grid;                   // threadgroups per grid
    Dim3 threadgroup;            // threads per threadgroup
};

struct Plan {
    FlashParams params;
    std::vector<Launch> launches;
    int64_t delta_elements = 0;  // scratch floats the plan needs (0: none)
};

Plan plan_forward(const FlashParams& p);
Plan plan_backward(const FlashParams& p);

}  // namespace flashattn
