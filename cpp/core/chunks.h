// A plan's launches cut into pieces of bounded GPU work, and the pieces
// grouped into command buffers, so that no command buffer runs long enough
// for macOS's GPU watchdog to kill it (kIOGPUCommandBufferCallbackErrorTimeout).
// Platform-free: the metal host encodes exactly this schedule, and metal-sim's
// run_plan runs the same one, so the splitting is tested on every machine.
//
// Each piece is a box of a launch's grid with its own origin; the host passes
// the origin in a copy of the params (FlashParams::group_offset_*), which every
// kernel adds to its [[threadgroup_position_in_grid]]. Threadgroups of one
// launch never depend on each other, so any cut gives bit-identical results.
//
// Work model (conservative, kernel-agnostic: it needs only the params and the
// grid). The heaviest kernel of the project, dK/dV, does four Tq x Tk x D
// matrix products (S = QK^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q), so every
// launch is charged 8 B H Tq Tk D FLOPs, unmasked, spread evenly over its
// threadgroups. When a grid cuts rows (or keys) evenly, that even share bounds
// every threadgroup's work even under causal or window masks, which only
// remove work. The smallest Apple GPU (M1, 8 cores) peaks at about 2.6 TFLOP/s
// fp32. Assuming kernels reach only a quarter of that, and that a threadgroup
// runs on one core (1/8 of the GPU) so a piece of N groups takes ceil(N / 8)
// waves of one group's time on one core, a piece is estimated to take
//   ceil(N / cores) * flops_per_group / (efficiency * peak / cores)  seconds,
// and a command buffer holds pieces adding up to command_buffer_seconds
// (0.25 s, ~0.16e12 FLOPs at full occupancy): a tenth or less of the
// watchdog's seconds even if the kernels are 2.5x slower than assumed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/plan.h"

namespace flashattn {

// The model's figures (see above), named so a reader can check the arithmetic.
struct WorkModel {
    double device_flops = 2.6e12;       // M1 (8 GPU cores) fp32 peak
    double efficiency = 0.25;           // the fraction of peak kernels are assumed to reach
    double gpu_cores = 8;               // a threadgroup runs on one of them
    double command_buffer_seconds = 0.25;  // target time of one command buffer
    // 0 = no limit; else at most this many threadgroups per piece (tests, the
    // FLASHATTN_MAX_GROUPS_PER_PIECE knob).
    uint64_t max_groups_per_piece = 0;

    // The model's time for `groups` threadgroups of `flops_per_group` each.
    double seconds(uint64_t groups, double flops_per_group) const;
    // The most threadgroups of `flops_per_group` that fit one command buffer
    // (>= 1: one threadgroup cannot be cut here), also capped by max_groups_per_piece.
    uint64_t groups_per_piece(double flops_per_group) const;
};

// The default model, with FLASHATTN_MAX_GROUPS_PER_PIECE (a positive integer)
// applied when set; any other value throws std::invalid_argument naming it.
WorkModel work_model_from_env();

// Estimated FLOPs of one threadgroup of `launch` (the model above).
double flops_per_threadgroup(const Launch& launch, const FlashParams& p);

// One box of a launch's grid: threadgroups [origin, origin + grid).
struct Piece {
    size_t launch = 0;  // index into Plan::launches
    Dim3 origin{0, 0, 0};
    Dim3 grid;
    double seconds = 0;  // the model's estimate for the whole piece
};

// Cuts `grid` into boxes of at most `max_groups` threadgroups (>= 1), whole
// z-slabs first, then y-rows, then x-runs, in order; their union is the grid.
std::vector<Piece> split_grid(const Dim3& grid, uint64_t max_groups);

// The plan's launches as pieces in launch order (empty grids left out), and
// command buffers as consecutive runs of them: command_buffers[i] is the index
// of the first piece of buffer i. Launches run in order within a buffer and
// buffers in order on the queue, so each launch still sees the previous one's
// writes.
struct Schedule {
    std::vector<Piece> pieces;
    std::vector<size_t> command_buffers;

    size_t end_of_buffer(size_t i) const {
        return i + 1 < command_buffers.size() ? command_buffers[i + 1] : pieces.size();
    }
};

Schedule schedule_plan(const Plan& plan, const WorkModel& model);

// plan.params with the piece's origin as the threadgroup offset.
FlashParams params_for_piece(const FlashParams& params, const Piece& piece);

}  // namespace flashattn
