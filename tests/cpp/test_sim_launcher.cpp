// The metal-sim launcher on its own: SIMD-group functions give each lane the
// right value, threadgroup memory is shared within a group and never leaks
// between groups, and GPU misuse (divergent barriers or SIMD calls, too much
// threadgroup memory, bindings that do not fit) is reported, not hung on.
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "sim/launcher.h"

#include <metal_stdlib>

#include "sim_launcher_kernels.metal"

#undef device
#undef constant
#undef threadgroup
#undef thread
#undef kernel

#include "sim/bind.h"

using namespace flashattn;
using namespace flashattn::sim;

namespace {

std::string launch_error(const Kernel& k, std::vector<float>& out, Dim3 grid, Dim3 group) {
    try {
        run_launch(k, {{out.data(), false}}, grid, group);
    } catch (const std::runtime_error& e) {
        return e.what();
    }
    return "";
}

}  // namespace

int main() {
    std::printf("execution mode: %s\n", execution_mode());
    // SIMD-group functions, two SIMD groups per threadgroup, two groups.
    {
        const Kernel k = make_kernel("simd_functions", &simd_functions);
        std::vector<float> out(2 * 64 * 8, -1.0f);
        run_launch(k, {{out.data(), false}}, Dim3{2, 1, 1}, Dim3{64, 1, 1});
        auto x = [](unsigned tid) { return float(tid * 3 % 7) + 0.5f * float(tid / 32); };
        int bad = 0;
        for (unsigned g = 0; g < 2; ++g)
            for (unsigned tid = 0; tid < 64; ++tid) {
                const unsigned sg = tid / 32, lane = tid % 32, first = sg * 32;
                float sum = 0, mx = -1e30f, mn = 1e30f;
                for (unsigned l = 0; l < 32; ++l) {
                    sum += x(first + l);
                    mx = std::max(mx, x(first + l));
                    mn = std::min(mn, x(first + l));
                }
                const float* r = &out[(g * 64 + tid) * 8];
                const float want[8] = {sum,
                                       mx,
                                       mn,
                                       x(first + (lane + 5) % 32),
                                       x(first + 7),
                                       x(first + (lane ^ 1)),
                                       lane + 3 < 32 ? x(tid + 3) : x(tid),
                                       lane >= 2 ? x(tid - 2) : x(tid)};
                for (int n = 0; n < 8; ++n) bad += r[n] != want[n];
            }
        CHECK(bad == 0);
    }
    // Threadgroup memory: garbage (NaN) on entry to every group, shared within it.
    {
        const Kernel k = make_kernel("threadgroup_isolation", &threadgroup_isolation);
        std::vector<float> before(3 * 64, 0.0f), after(3 * 64, 0.0f);
        run_launch(k, {{before.data(), false}, {after.data(), false}}, Dim3{3, 1, 1},
                   Dim3{64, 1, 1});
        int leaked = 0, wrong = 0;
        for (unsigned g = 0; g < 3; ++g)
            for (unsigned t = 0; t < 64; ++t) {
                leaked += !std::isnan(before[g * 64 + t]);
                wrong += after[g * 64 + t] != float(g * 1000 + (t + 1) % 64);
            }
        CHECK(leaked == 0);
        CHECK(wrong == 0);
    }
    // Misuse is an error naming the kernel and the threadgroup, not a hang.
    {
        std::vector<float> out(64, 0.0f);
        const std::string e1 = launch_error(make_kernel("divergent_barrier", &divergent_barrier),
                                            out, Dim3{2, 1, 1}, Dim3{32, 1, 1});
        std::printf("divergent barrier: %s\n", e1.c_str());
        CHECK(e1.find("divergent_barrier") != std::string::npos);
        CHECK(e1.find("threadgroup_barrier") != std::string::npos);
        CHECK(e1.find("threadgroup (0, 0, 0)") != std::string::npos);

        const std::string e2 = launch_error(make_kernel("divergent_simd", &divergent_simd), out,
                                            Dim3{1, 1, 1}, Dim3{32, 1, 1});
        std::printf("divergent simd: %s\n", e2.c_str());
        CHECK(e2.find("SIMD-group") != std::string::npos);

        const std::string e3 =
            launch_error(make_kernel("too_much_threadgroup_memory", &too_much_threadgroup_memory),
                         out, Dim3{1, 1, 1}, Dim3{32, 1, 1});
        std::printf("too much threadgroup memory: %s\n", e3.c_str());
        CHECK(e3.find("36000 bytes of threadgroup memory") != std::string::npos);

        // A wait that can never finish: reported in fiber mode; in thread
        // mode the threads would block forever, so it is not run there.
        if (std::string(execution_mode()) == "fibers") {
            std::vector<float> wide(64, 0.0f);
            const std::string e5 = launch_error(
                make_kernel("simd_against_barrier", &simd_against_barrier), wide, Dim3{1, 1, 1},
                Dim3{64, 1, 1});
            std::printf("SIMD call against barrier: %s\n", e5.c_str());
            CHECK(e5.find("wait for each other forever") != std::string::npos);
        } else {
            std::printf("threads mode: SIMD call against barrier not run (it would hang)\n");
        }

        // Bindings that do not fit the kernel's parameters.
        const Kernel k = make_kernel("threadgroup_isolation", &threadgroup_isolation);
        CHECK(launch_error(k, out, Dim3{1, 1, 1}, Dim3{64, 1, 1}).find("parameter 1") !=
              std::string::npos);
        std::string e4;
        try {
            run_launch(k, {{out.data(), false}, {out.data(), false}}, Dim3{1, 1, 1}, Dim3{2000, 1, 1});
        } catch (const std::runtime_error& e) {
            e4 = e.what();
        }
        CHECK(e4.find("threads per threadgroup") != std::string::npos);
    }
    // Every kernel a plan can name is in the table, and nothing else.
    {
        int found = 0;
        for (const char* name : {"flash_fwd_f32_hd32", "flash_fwd_f32_hd256", "flash_bwd_dq_f32_hd96",
                                 "flash_bwd_dkdv_f32_hd128", "flash_bwd_preprocess_f32",
                                 "flash_fwd_merge_f32", "flash_fwd_f16_hd64", "flash_bwd_dq_bf16_hd256",
                                 "flash_bwd_dkdv_f16_hd32", "flash_bwd_preprocess_bf16",
                                 "flash_fwd_merge_f16"})
            found += find_kernel(name) != nullptr;
        CHECK(found == 11);
        // 3 storage types x (preprocess, merge; 5 buckets x (fwd, decode,
        // dq, dkdv)), and the self-test's lane probe (flash_selftest_lanes,
        // core/selftest.h)
        CHECK(find_kernel("flash_selftest_lanes") != nullptr);
        CHECK(find_kernel("flash_decode_bf16_hd96") != nullptr);
        CHECK(kernels().size() == 3 * (2 + 5 * 4) + 1);
        CHECK(find_kernel("flash_fwd_f32_hd48") == nullptr);
    }
    // A tiled kernel declares max_total_threads_per_threadgroup(FA_THREADS):
    // a launch of more threads is refused, naming the kernel, before anything
    // runs (Metal refuses a dispatch above the pipeline's limit).
    {
        std::string e;
        try {
            run_launch(*find_kernel("flash_fwd_f16_hd64"), {}, Dim3{1, 1, 1}, Dim3{512, 1, 1});  // 4 x FA_THREADS
        } catch (const std::runtime_error& x) {
            e = x.what();
        }
        CHECK(e.find("flash_fwd_f16_hd64") != std::string::npos &&
              e.find("max_total_threads_per_threadgroup") != std::string::npos);
    }
    return flashattn_test::finish("test_sim_launcher");
}
