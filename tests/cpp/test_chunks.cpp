// Watchdog splitting (cpp/core/chunks.h): grids cut into boxes that cover each
// threadgroup exactly once, pieces within the model's budget, command buffers
// in launch order, the origin carried in the params, and the env knob.
#include <cstdlib>
#include <set>
#include <tuple>
#include <vector>

#include "check.h"
#include "core/chunks.h"
#include "core/plan.h"

using namespace flashattn;

namespace {

FlashParams params(int B, int Tq, int Tk, int H, int Hkv, int D) {
    FlashParams p{};
    p.B = B, p.Tq = Tq, p.Tk = Tk, p.H = H, p.Hkv = Hkv, p.D = D;
    p.group = H / Hkv;
    p.window_left = Tk;
    p.window_right = Tq;
    p.scale = 0.125f;
    p.kv_splits = 1;
    return p;
}

// Every threadgroup of `grid` in exactly one piece, and no piece past max_groups.
bool covers_exactly(const std::vector<Piece>& pieces, const Dim3& grid, uint64_t max_groups) {
    std::set<std::tuple<uint32_t, uint32_t, uint32_t>> seen;
    for (const Piece& p : pieces) {
        if (uint64_t(p.grid.x) * p.grid.y * p.grid.z > max_groups) return false;
        if (p.grid.x == 0 || p.grid.y == 0 || p.grid.z == 0) return false;
        for (uint32_t z = 0; z < p.grid.z; ++z)
            for (uint32_t y = 0; y < p.grid.y; ++y)
                for (uint32_t x = 0; x < p.grid.x; ++x) {
                    const auto g = std::make_tuple(p.origin.x + x, p.origin.y + y, p.origin.z + z);
                    if (std::get<0>(g) >= grid.x || std::get<1>(g) >= grid.y ||
                        std::get<2>(g) >= grid.z)
                        return false;
                    if (!seen.insert(g).second) return false;  // twice
                }
    }
    return seen.size() == uint64_t(grid.x) * grid.y * grid.z;
}

}  // namespace

int main() {
    // Cuts: whole planes, whole rows, runs of x; awkward sizes on purpose.
    for (const Dim3 grid : {Dim3{7, 5, 3}, Dim3{1, 1, 1}, Dim3{13, 1, 1}, Dim3{2, 9, 4}}) {
        for (uint64_t max_groups : {1ull, 2ull, 3ull, 6ull, 7ull, 34ull, 35ull, 36ull, 1000ull}) {
            const std::vector<Piece> pieces = split_grid(grid, max_groups);
            CHECK(covers_exactly(pieces, grid, max_groups));
        }
    }
    CHECK(split_grid(Dim3{7, 5, 3}, 105).size() == 1);  // fits: not cut
    CHECK(split_grid(Dim3{7, 5, 3}, 35).size() == 3);   // one z-plane each
    CHECK(split_grid(Dim3{7, 5, 3}, 14).size() == 9);   // two rows of 7 at a time: 3 per plane
    CHECK(split_grid(Dim3{0, 5, 3}, 4).empty());
    CHECK_THROWS(std::invalid_argument, "max_groups", split_grid(Dim3{1, 1, 1}, 0));

    const WorkModel model;
    // The model's arithmetic: 8 waves of 8 groups; one wave of one group's time.
    CHECK(model.seconds(8, 1e9) == model.seconds(1, 1e9));
    CHECK(model.seconds(9, 1e9) == 2 * model.seconds(8, 1e9));
    CHECK(model.seconds(8, 1e9) == 1e9 / (2.6e12 * 0.25 / 8));

    // A small call: one piece per launch, everything in one command buffer.
    {
        const Plan plan = plan_backward(params(2, 113, 203, 8, 2, 64));
        const Schedule s = schedule_plan(plan, model);
        CHECK(s.pieces.size() == plan.launches.size());
        CHECK(s.command_buffers.size() == 1);
        for (size_t i = 0; i < s.pieces.size(); ++i) CHECK(s.pieces[i].launch == i);
    }

    // A long call (B=4, T=32768, H=32, D=128: ~1.1e15 FLOPs charged per
    // launch): cut so that no command buffer passes the model's budget unless
    // it is a single threadgroup, and pieces stay in launch order.
    {
        const Plan plan = plan_backward(params(4, 32768, 32768, 32, 8, 128));
        const Schedule s = schedule_plan(plan, model);
        CHECK(s.command_buffers.size() > 100);
        size_t last_launch = 0;
        for (size_t b = 0; b < s.command_buffers.size(); ++b) {
            double seconds = 0;
            uint64_t groups = 0;
            for (size_t i = s.command_buffers[b]; i < s.end_of_buffer(b); ++i) {
                seconds += s.pieces[i].seconds;
                groups += uint64_t(s.pieces[i].grid.x) * s.pieces[i].grid.y * s.pieces[i].grid.z;
                CHECK(s.pieces[i].launch >= last_launch);
                last_launch = s.pieces[i].launch;
            }
            CHECK(seconds <= model.command_buffer_seconds || groups == 1);
        }
        for (size_t l = 0; l < plan.launches.size(); ++l) {
            std::vector<Piece> of_launch;
            for (const Piece& p : s.pieces)
                if (p.launch == l) of_launch.push_back(p);
            CHECK(covers_exactly(of_launch, plan.launches[l].grid, UINT64_MAX));
        }
    }

    // The knob: at most N groups per piece, each piece its own command buffer.
    {
        WorkModel tiny;
        tiny.max_groups_per_piece = 3;
        const Plan plan = plan_forward(params(2, 300, 300, 4, 4, 32));
        const Schedule s = schedule_plan(plan, tiny);
        CHECK(covers_exactly(s.pieces, plan.launches[0].grid, 3));
        CHECK(s.command_buffers.size() == s.pieces.size());
    }

    // The origin travels in the params; nothing else changes.
    {
        const FlashParams p = params(2, 300, 300, 4, 4, 32);
        Piece piece;
        piece.origin = Dim3{3, 1, 1};
        const FlashParams q = params_for_piece(p, piece);
        CHECK(q.group_offset_x == 3 && q.group_offset_y == 1 && q.group_offset_z == 1);
        CHECK(q.Tq == p.Tq && q.scale == p.scale && q.q.t == p.q.t);
    }

    // FLASHATTN_MAX_GROUPS_PER_PIECE: a positive integer, else an error naming it.
    setenv("FLASHATTN_MAX_GROUPS_PER_PIECE", "5", 1);
    CHECK(work_model_from_env().max_groups_per_piece == 5);
    setenv("FLASHATTN_MAX_GROUPS_PER_PIECE", "0", 1);
    CHECK_THROWS(std::invalid_argument, "FLASHATTN_MAX_GROUPS_PER_PIECE", work_model_from_env());
    setenv("FLASHATTN_MAX_GROUPS_PER_PIECE", "lots", 1);
    CHECK_THROWS(std::invalid_argument, "'lots'", work_model_from_env());
    unsetenv("FLASHATTN_MAX_GROUPS_PER_PIECE");
    CHECK(work_model_from_env().max_groups_per_piece == 0);

    return flashattn_test::finish("test_chunks");
}
