// Cuts a plan's grids into pieces of bounded work and groups them into
// command buffers (the model is described in chunks.h).
#include "core/chunks.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace flashattn {

double WorkModel::seconds(uint64_t groups, double flops_per_group) const {
    const double per_core = device_flops * efficiency / gpu_cores;
    const double waves = std::ceil(double(groups) / gpu_cores);
    return waves * flops_per_group / per_core;
}

uint64_t WorkModel::groups_per_piece(double flops_per_group) const {
    uint64_t n = 1;
    if (flops_per_group > 0) {
        const double per_core = device_flops * efficiency / gpu_cores;
        const double waves = std::floor(command_buffer_seconds * per_core / flops_per_group);
        // Cap before converting: a tiny launch would overflow uint64_t.
        if (waves >= 1) n = uint64_t(std::min(waves * gpu_cores, 1e18));
    } else {
        n = UINT64_MAX;
    }
    if (max_groups_per_piece > 0) n = std::min(n, max_groups_per_piece);
    return std::max<uint64_t>(n, 1);
}

WorkModel work_model_from_env() {
    WorkModel model;
    const char* text = std::getenv("FLASHATTN_MAX_GROUPS_PER_PIECE");
    if (text && *text) {
        char* end = nullptr;
        errno = 0;
        const long long n = std::strtoll(text, &end, 10);
        if (errno != 0 || *end != '\0' || n < 1)
            throw std::invalid_argument(
                std::string("FLASHATTN_MAX_GROUPS_PER_PIECE: must be a positive integer, got '") +
                text + "'");
        model.max_groups_per_piece = uint64_t(n);
    }
    return model;
}

double flops_per_threadgroup(const Launch& launch, const FlashParams& p) {
    const double groups = double(launch.grid.x) * launch.grid.y * launch.grid.z;
    if (groups == 0) return 0;
    const double call = 8.0 * p.B * p.H * double(p.Tq) * double(p.Tk) * p.D;
    return call / groups;
}

std::vector<Piece> split_grid(const Dim3& grid, uint64_t max_groups) {
    if (max_groups < 1)
        throw std::invalid_argument("split_grid: max_groups must be >= 1, got " +
                                    std::to_string(max_groups));
    std::vector<Piece> pieces;
    const uint64_t x = grid.x, y = grid.y, z = grid.z;
    if (x * y * z == 0) return pieces;
    auto add = [&](uint32_t ox, uint32_t oy, uint32_t oz, uint32_t nx, uint32_t ny, uint32_t nz) {
        Piece piece;
        piece.origin = Dim3{ox, oy, oz};
        piece.grid = Dim3{nx, ny, nz};
        pieces.push_back(piece);
    };
    if (x * y <= max_groups) {  // whole xy-planes, several z at a time
        const uint64_t step = std::min<uint64_t>(z, max_groups / (x * y));
        for (uint64_t oz = 0; oz < z; oz += step)
            add(0, 0, uint32_t(oz), uint32_t(x), uint32_t(y), uint32_t(std::min(step, z - oz)));
    } else if (x <= max_groups) {  // whole x-rows, several y at a time, one z
        const uint64_t step = max_groups / x;
        for (uint64_t oz = 0; oz < z; ++oz)
            for (uint64_t oy = 0; oy < y; oy += step)
                add(0, uint32_t(oy), uint32_t(oz), uint32_t(x), uint32_t(std::min(step, y - oy)), 1);
    } else {  // runs of x, one y and z
        for (uint64_t oz = 0; oz < z; ++oz)
            for (uint64_t oy = 0; oy < y; ++oy)
                for (uint64_t ox = 0; ox < x; ox += max_groups)
                    add(uint32_t(ox), uint32_t(oy), uint32_t(oz),
                        uint32_t(std::min(max_groups, x - ox)), 1, 1);
    }
    return pieces;
}

Schedule schedule_plan(const Plan& plan, const WorkModel& model) {
    Schedule schedule;
    double buffer_seconds = 0;
    for (size_t i = 0; i < plan.launches.size(); ++i) {
        const Launch& launch = plan.launches[i];
        const double per_group = flops_per_threadgroup(launch, plan.params);
        for (Piece piece : split_grid(launch.grid, model.groups_per_piece(per_group))) {
            piece.launch = i;
            piece.seconds =
                model.seconds(uint64_t(piece.grid.x) * piece.grid.y * piece.grid.z, per_group);
            // A new command buffer when this piece would push the current one
            // past its time (a piece alone may exceed it only when it is one
            // threadgroup that cannot be cut), or when the knob asks for
            // tiny pieces (then every piece gets its own buffer, as a test
            // of the most cut-up schedule).
            const bool full = buffer_seconds + piece.seconds > model.command_buffer_seconds ||
                              model.max_groups_per_piece > 0;
            if (schedule.command_buffers.empty() || full) {
                schedule.command_buffers.push_back(schedule.pieces.size());
                buffer_seconds = 0;
            }
            buffer_seconds += piece.seconds;
            schedule.pieces.push_back(piece);
        }
    }
    return schedule;
}

FlashParams params_for_piece(const FlashParams& params, const Piece& piece) {
    FlashParams p = params;
    p.group_offset_x = fa_int(piece.origin.x);
    p.group_offset_y = fa_int(piece.origin.y);
    p.group_offset_z = fa_int(piece.origin.z);
    return p;
}

}  // namespace flashattn
