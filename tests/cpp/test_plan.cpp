// The plans the metal host and metal-sim both execute: which kernels, with
// which buffers bound in [[buffer(n)]] order, on which grids.
#include <string>
#include <vector>

#include "check.h"
#include "core/plan.h"
#include "flash_kernels.h"

using namespace flashattn;

namespace {

FlashParams params(int B, int Tq, int Tk, int H, int Hkv, int D) {
    FlashParams p{};
    p.B = B, p.Tq = Tq, p.Tk = Tk, p.H = H, p.Hkv = Hkv, p.D = D;
    p.group = H / Hkv;
    p.window_left = Tk;
    p.window_right = Tq;
    p.scale = 0.125f;
    return p;
}

bool same(const Dim3& a, uint32_t x, uint32_t y, uint32_t z) { return a.x == x && a.y == y && a.z == z; }

}  // namespace

int main() {
    // Forward: one launch, query rows in groups of 64, grid (groups, H, B).
    {
        const Plan plan = plan_forward(params(2, 113, 203, 8, 2, 64));
        CHECK(plan.launches.size() == 1);
        CHECK(plan.scratch.empty());
        CHECK(plan.params.Tq == 113 && plan.params.D == 64);
        const Launch& l = plan.launches[0];
        CHECK(l.kernel == "flash_fwd_f32_hd64");
        CHECK((l.buffers == std::vector<Slot>{Slot::q, Slot::k, Slot::v, Slot::o, Slot::lse, Slot::params}));
        CHECK(same(l.grid, 2, 8, 2));
        CHECK(same(l.threadgroup, 64, 1, 1));
    }
    // Decode: one query row still gets one threadgroup per (head, batch).
    {
        const Plan plan = plan_forward(params(3, 1, 1000, 4, 1, 128));
        CHECK(plan.launches[0].kernel == "flash_fwd_f32_hd128");
        CHECK(same(plan.launches[0].grid, 1, 4, 3));
    }
    // Head size buckets: the smallest that holds D, D itself a run-time bound.
    {
        const int D[] = {1, 32, 33, 59, 64, 65, 96, 97, 111, 128, 129, 200, 256};
        const char* want[] = {"hd32", "hd32", "hd64", "hd64", "hd64", "hd96", "hd96",
                              "hd128", "hd128", "hd128", "hd256", "hd256", "hd256"};
        for (int n = 0; n < 13; ++n) {
            const std::string name = plan_forward(params(1, 5, 5, 1, 1, D[n])).launches[0].kernel;
            CHECK(name == std::string("flash_fwd_f32_") + want[n]);
        }
        CHECK_THROWS(std::invalid_argument, "head size", plan_forward(params(1, 5, 5, 1, 1, 257)));
        CHECK_THROWS(std::invalid_argument, "head size", plan_backward(params(1, 5, 5, 1, 1, 0)));
    }
    // Backward: preprocess, dq (over query rows), dkdv (over key rows of each kv head).
    {
        const Plan plan = plan_backward(params(2, 130, 65, 6, 3, 111));
        CHECK(plan.launches.size() == 3);
        CHECK(plan.scratch.size() == 1 && plan.scratch[0].slot == Slot::delta &&
              plan.scratch[0].floats == 2 * 6 * 130);
        const Launch& pre = plan.launches[0];
        CHECK(pre.kernel == "flash_bwd_preprocess_f32");
        CHECK((pre.buffers == std::vector<Slot>{Slot::dout, Slot::o, Slot::delta, Slot::params}));
        CHECK(same(pre.grid, 3, 6, 2));
        const Launch& dq = plan.launches[1];
        CHECK(dq.kernel == "flash_bwd_dq_f32_hd128");
        CHECK((dq.buffers == std::vector<Slot>{Slot::q, Slot::k, Slot::v, Slot::dout, Slot::lse,
                                               Slot::delta, Slot::dq, Slot::params}));
        CHECK(same(dq.grid, 3, 6, 2));
        const Launch& dkdv = plan.launches[2];
        CHECK(dkdv.kernel == "flash_bwd_dkdv_f32_hd128");
        CHECK((dkdv.buffers == std::vector<Slot>{Slot::q, Slot::k, Slot::v, Slot::dout, Slot::lse,
                                                 Slot::delta, Slot::dk, Slot::dv, Slot::params}));
        CHECK(same(dkdv.grid, 2, 3, 2));
        for (const Launch& l : plan.launches) CHECK(same(l.threadgroup, FA_ROWS_PER_GROUP, 1, 1));
    }
    // Empty calls never reach a plan (run_forward answers them).
    CHECK_THROWS(std::invalid_argument, "plan_forward", plan_forward(params(1, 0, 5, 1, 1, 8)));
    CHECK_THROWS(std::invalid_argument, "plan_backward", plan_backward(params(1, 5, 0, 1, 1, 8)));

    CHECK(std::string(slot_name(Slot::delta)) == "delta");
    CHECK(std::string(slot_name(Slot::params)) == "params");
    return flashattn_test::finish("test_plan");
}
