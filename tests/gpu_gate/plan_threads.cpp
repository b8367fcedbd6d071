// Prints the threadgroup size the plan gives each kernel it launches (0 for
// a threadgroup that is not one-dimensional, which the gate rejects), one
// "kernel threads" line per (kernel, size), over plans for every head size
// and a spread of shapes (decode with split keys, GQA, ragged lengths): the
// gate compiles each kernel with exactly the launch bound the host uses.
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <string>

#include "core/plan.h"

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

}  // namespace

int main() {
    std::map<std::string, std::set<uint64_t>> threads;
    auto note = [&](const Plan& plan) {
        for (const Launch& l : plan.launches)
            threads[l.kernel].insert(l.threadgroup.y * l.threadgroup.z == 1 ? l.threadgroup.x : 0);
    };
    const int lengths[][2] = {{1, 4096}, {4, 4096}, {32, 4096}, {113, 203}, {300, 300}, {1024, 1024}};
    const int heads[][2] = {{1, 1}, {4, 1}, {8, 1}, {8, 2}};
    for (int D = 1; D <= 256; ++D)
        for (const auto& t : lengths)
            for (const auto& h : heads)
                for (int B : {1, 2}) {
                    const FlashParams p = shape(B, t[0], t[1], h[0], h[1], D);
                    note(plan_forward(p));
                    note(plan_backward(p));
                }
    for (const auto& [name, sizes] : threads)
        for (uint64_t n : sizes) std::printf("%s %llu\n", name.c_str(), (unsigned long long)n);
    return 0;
}
