// Prints how the plan launches each kernel, one line per distinct
// (kernel, threads per threadgroup, function constants), over plans for
// every head size and a spread of shapes (decode with split keys, GQA,
// ragged lengths), in every storage type (f32, f16, bf16):
//   <kernel> <threads> <index>=<bits>,...   (or "-" for no constants)
// threads is 0 for a threadgroup that is not one-dimensional (the gate
// rejects it). The gate compiles each kernel with exactly the launch bound
// and the function-constant values the host uses.
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>

#include "core/plan.h"
#include "core/selftest.h"

using namespace flashattn;

namespace {

FlashParams shape(int B, int Tq, int Tk, int H, int Hkv, int D) {
    FlashParams p{};
    p.B = B, p.Tq = Tq, p.Tk = Tk, p.H = H, p.Hkv = Hkv, p.D = D;
    p.group = H / Hkv;
    p.window_left = Tk;  // unbounded, as make_forward_params normalises it
    p.window_right = Tq;
    p.scale = 0.125f;
    return p;
}

std::string describe(const Launch& l) {
    const uint32_t threads = l.threadgroup.y * l.threadgroup.z == 1 ? l.threadgroup.x : 0;
    std::string constants;
    for (const FunctionConstant& c : l.constants)
        constants += (constants.empty() ? "" : ",") + std::to_string(c.index) + "=" + std::to_string(c.bits);
    return l.kernel + " " + std::to_string(threads) + " " + (constants.empty() ? "-" : constants);
}

// The forward's plan for the default GPU (the split-KV count changes no kernel).
Plan forward_plan(const FlashParams& p, DType dtype) { return plan_forward(p, dtype); }

}  // namespace

int main() {
    std::set<std::string> lines;
    // Every storage type (issue 15) plans the same launches under its own names.
    auto plan = [&](Plan (*make)(const FlashParams&, DType), const FlashParams& p) {
        for (DType dt : {DType::f32, DType::f16, DType::bf16})
            for (const Launch& l : make(p, dt).launches) lines.insert(describe(l));
    };
    const int lengths[][2] = {{1, 4096}, {4, 4096}, {32, 4096}, {113, 203}, {300, 300}, {1024, 1024}};
    const int heads[][2] = {{1, 1}, {4, 1}, {8, 1}, {8, 2}};
    for (int D = 1; D <= 256; ++D)
        for (const auto& t : lengths)
            for (const auto& h : heads)
                for (int B : {1, 2}) {
                    const FlashParams p = shape(B, t[0], t[1], h[0], h[1], D);
                    plan(forward_plan, p);
                    plan(plan_backward, p);
                }
    // Every score option at once (issue 16): the heaviest variant of each
    // kernel (MHA decode: the vector kernel's).
    for (int D = 1; D <= 256; ++D)
        for (const FlashParams& base : {shape(2, 113, 203, 8, 2, D), shape(2, 1, 203, 8, 8, D)}) {
            FlashParams p = base;
            p.score_mods = FA_SCORE_SOFTCAP | FA_SCORE_ALIBI | FA_SCORE_MASK_FLOAT | FA_SCORE_SINKS;
            plan(forward_plan, p);
            plan(plan_backward, p);
            p.score_mods = FA_SCORE_SOFTCAP | FA_SCORE_ALIBI | FA_SCORE_MASK_BOOL | FA_SCORE_SINKS;
            plan(forward_plan, p);
            plan(plan_backward, p);
        }
    // A variable-length batch in one launch (issue 34; FA_FC_VARLEN = 1):
    // plain, and with every score option varlen takes (no mask); GQA, and
    // MHA decode (the vector kernel).
    for (int D = 1; D <= 256; ++D)
        for (const FlashParams& base : {shape(3, 113, 203, 8, 2, D), shape(3, 1, 203, 8, 8, D)}) {
            FlashParams p = base;
            p.varlen_seqs = p.B;
            plan(forward_plan, p);
            plan(plan_backward, p);
            p.score_mods = FA_SCORE_SOFTCAP | FA_SCORE_ALIBI | FA_SCORE_SINKS;
            plan(forward_plan, p);
            plan(plan_backward, p);
        }
    // The self-test's lane probe (core/selftest.h), launched at engine start.
    lines.insert(describe(lane_probe_launch()));
    for (const std::string& line : lines) std::printf("%s\n", line.c_str());
    return 0;
}
