// Helpers only kernel code uses (it needs the Metal vector types and address
// spaces, so C++ host code never includes this file).
#pragma once

#include "flash_kernels.h"

// The threadgroup's position in the whole launch: its position in the
// dispatched piece plus the piece's origin (FlashParams::group_offset_*).
FA_INLINE uint3 fa_group_position(uint3 grid_pos, constant FlashParams& p) {
    return uint3(grid_pos.x + uint(p.group_offset_x), grid_pos.y + uint(p.group_offset_y),
                 grid_pos.z + uint(p.group_offset_z));
}
