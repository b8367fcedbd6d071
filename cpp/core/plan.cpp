// Turns a validated call into the kernel launches that compute it: kernel
// names (spelling the head-size bucket), buffer bindings in [[buffer(n)]]
// order, grids and threadgroup sizes. The metal host and metal-sim both run
// exactly this, so the sizes chosen here are tested on every machine.
#include "core/plan.h"

#include <stdexcept>

#include "flash_kernels.h"

namespace flashattn {

const char* slot_name(Slot s) {
    switch (s) {
        case Slot::q: return "q";
        case Slot::k: return "k";
        case Slot::v: return "v";
        case Slot::o: return "o";
        case Slot::lse: return "lse";
        case Slot::dout: return "dout";
        case Slot::dq: return "dq";
        case Slot::dk: return "dk";
        case Slot::dv: return "dv";
        case Slot::delta: return "delta";
        case Slot::partial_o: return "partial_o";
        case Slot::partial_lse: return "partial_lse";
        case Slot::params: return "params";
    }
    return "?";
}

namespace {

// Groups of FA_ROWS_PER_GROUP rows covering `rows`.
uint32_t row_groups(int64_t rows) {
    return uint32_t((rows + FA_ROWS_PER_GROUP - 1) / FA_ROWS_PER_GROUP);
}

std::string bucket_suffix(const char* fn, const FlashParams& p) {
    const int bucket = fa_head_bucket(p.D);
    if (bucket == 0)
        throw std::invalid_argument(std::string(fn) + ": head size D must be in 1..256, got " +
                                    std::to_string(p.D));
    return "_f32_hd" + std::to_string(bucket);
}

void check_shape(const char* fn, const FlashParams& p) {
    if (p.B < 1 || p.Tq < 1 || p.Tk < 1 || p.H < 1 || p.Hkv < 1 || p.group < 1 ||
        p.group * p.Hkv != p.H)
        throw std::invalid_argument(std::string(fn) +
                                    ": needs B, Tq, Tk, H, Hkv >= 1 and H = group * Hkv (empty "
                                    "calls are answered before planning)");
}

const Dim3 kGroup{FA_ROWS_PER_GROUP, 1, 1};

}  // namespace

Plan plan_forward(const FlashParams& p) {
    check_shape("plan_forward", p);
    Plan plan;
    plan.params = p;
    plan.launches.push_back(Launch{
        "flash_fwd" + bucket_suffix("plan_forward", p),
        {Slot::q, Slot::k, Slot::v, Slot::o, Slot::lse, Slot::params},
        Dim3{row_groups(p.Tq), uint32_t(p.H), uint32_t(p.B)},
        kGroup,
        {},
    });
    return plan;
}

Plan plan_backward(const FlashParams& p) {
    check_shape("plan_backward", p);
    const std::string suffix = bucket_suffix("plan_backward", p);
    Plan plan;
    plan.params = p;
    plan.scratch.push_back({Slot::delta, int64_t(p.B) * p.H * p.Tq});
    const Dim3 query_grid{row_groups(p.Tq), uint32_t(p.H), uint32_t(p.B)};
    plan.launches.push_back(Launch{
        "flash_bwd_preprocess_f32",
        {Slot::dout, Slot::o, Slot::delta, Slot::params},
        query_grid,
        kGroup,
        {},
    });
    plan.launches.push_back(Launch{
        "flash_bwd_dq" + suffix,
        {Slot::q, Slot::k, Slot::v, Slot::dout, Slot::lse, Slot::delta, Slot::dq, Slot::params},
        query_grid,
        kGroup,
        {},
    });
    plan.launches.push_back(Launch{
        "flash_bwd_dkdv" + suffix,
        {Slot::q, Slot::k, Slot::v, Slot::dout, Slot::lse, Slot::delta, Slot::dk, Slot::dv,
         Slot::params},
        Dim3{row_groups(p.Tk), uint32_t(p.Hkv), uint32_t(p.B)},
        kGroup,
        {},
    });
    return plan;
}

}  // namespace flashattn
