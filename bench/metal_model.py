#!/usr/bin/env python3
"""A cost model of the Metal kernels (docs/metal.md, "Cost model"): what one
step of each tiled kernel's loop costs on an Apple GPU core, and from it the
share of the ALU peak the kernel can reach. A MODEL, not a measurement: no
Mac has run these kernels here. It counts, per step (one staged block of
keys, or of queries for dK/dV) and per threadgroup, the operations the
kernels as written issue -- matrix multiply-accumulates, fragment loads from
threadgroup memory, device bytes staged, barriers, and the element-wise
instructions around them -- and prices them with the per-core rates below.

The counts of matrix operations, simdgroup loads and barriers are checked
against metal-sim's (tests/python/test_metal_model.py runs `check()`): the
model's kernels are the kernels in shaders/, not a description of them.

usage: python bench/metal_model.py [--check]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

# ---------------------------------------------------------------- the chips
# Per GPU core and cycle. Sources: Philip Turner's metal-benchmarks (README,
# "Operations per Second" and "On-Chip Memory": 128 FP32 or FP16 FMA lanes
# per core = 4 schedulers x 32 lanes, each scheduler issuing one instruction
# of one SIMD group per cycle; exp2 at 32 per core-cycle; ~208 KB of
# registers; ~60 KB of threadgroup memory; 32 B/cycle of L2 bandwidth per
# core); MFA's parameter files (Apple9 converts bfloat16 natively).
# Assumed, and marked so in docs/metal.md: threadgroup memory delivers 64
# B/cycle per core (no published figure; metal-benchmarks says Apple cut it
# back in favour of SIMD shuffles and matrix instructions; MFA's 86 % in half
# precision, one 128-byte fragment load per 8x8x8 product, needs at least
# 32), and a step's two barriers cost 200 core-cycles when only one
# threadgroup fits on a core (nothing else to run while it waits), nothing
# when two or more do.


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    family: str
    tg_bytes_per_cycle: float = 64.0
    l2_bytes_per_cycle: float = 32.0
    register_bytes: int = 208 * 1024
    tg_memory_bytes: int = 60 * 1024
    max_threads: int = 1024
    # Instructions (32-lane issue slots) to round a float to bfloat16, and to
    # widen a bfloat16: Apple7 rounds with integer instructions; Apple9 has
    # the conversions (MFA: hasNativeBF16Casting).
    bf16_round_slots: int = 5
    bf16_widen_slots: int = 1
    # Dynamic caching (Apple9): registers are not reserved for a kernel's
    # worst case, so they do not limit the threadgroups a core holds.
    registers_limit_occupancy: bool = True


CHIPS = [
    Chip("M1", "Apple7"),
    Chip("M3", "Apple9", bf16_round_slots=1, registers_limit_occupancy=False),
    Chip("M4", "Apple9", bf16_round_slots=1, registers_limit_occupancy=False),
]

MMA_SLOTS = 16      # an 8x8x8 product: 512 FMA over 32 lanes
EXP2_SLOTS = 4      # exp2 at a quarter of the FMA rate
SHUFFLE_SLOTS = 2   # 128 bytes over a 256 B/cycle crossbar, per scheduler
FLOPS_PER_CORE_CYCLE = 256  # 128 FMA lanes
BARRIER_STALL = 100  # core-cycles per barrier with nothing else resident


def elem_bytes(dtype: str) -> int:
    return 4 if dtype == "f32" else 2


# ------------------------------------------------------------- the kernels
@dataclasses.dataclass(frozen=True)
class Kernel:
    """The shape of one kernel's loop, as shaders/ writes it."""
    kind: str          # fwd | dq | dkdv
    HD: int            # head-size bucket (the model takes D = HD)
    dtype: str         # f32 | f16 | bf16
    block: int         # rows staged per step: keys (fwd, dq) or queries (dkdv)
    chunk: int         # columns of the accumulators per threadgroup (HD: no recompute)
    simdgroups: int    # 8 rows each
    resident: bool     # the SIMD group's own operand rows stay in registers (else reloaded per use)
    frag16: bool       # 16-bit operand fragments loaded by simdgroup_load (else float fragments)
    copy16: bool       # staging moves 16-byte vectors as they are (else converts per element)
    s_partials: int    # partial sums of S over D
    p_half: bool       # P (and dS) rounded to the storage type before their products
    delta_mma: bool    # dQ computes delta = rowsum(dO o) itself (else a preprocess kernel)
    registers: int     # per thread, from the GPU gate (docs/gpu-gate.md), for occupancy
    pad: int = 4       # elements of padding per staged row (FA_LD: 16 bytes after issue 30, 4 elements before)
    split: int = 1     # dQ, dK/dV: SIMD groups sharing 8 rows, each 1/split of D (FA_DQ_SPLIT, FA_DKDV_SPLIT)

    @property
    def threads(self) -> int:
        return 32 * self.simdgroups

    @property
    def rows(self) -> int:
        """Rows a threadgroup owns: queries (fwd, dq) or keys (dkdv)."""
        return 8 * self.simdgroups // self.split

    @property
    def ld(self) -> int:
        """Row pitch of a staged tile, in elements."""
        return self.HD + self.pad

    def tg_bytes(self) -> int:
        e = elem_bytes(self.dtype)
        tiles = 2 * self.block * self.ld * e
        if self.kind == "dkdv":
            tiles += 2 * 4 * self.block  # lse and delta rows
        if self.split > 1:               # the pairs' partial S and dP (S^T and dP^T)
            tiles += self.threads * self.block // 2 * 4
        return tiles

    # -- counts of one step, per SIMD group (matrix ops, loads) -----------
    def mma(self) -> int:
        b8, h8, c8 = self.block // 8, self.HD // 8 // self.split, self.chunk // 8 // self.split
        if self.kind == "fwd":
            return b8 * h8 + c8 * b8
        if self.kind == "dq":
            return 2 * b8 * h8 + c8 * b8
        return 2 * b8 * h8 + 2 * c8 * b8

    def fragment_loads(self) -> tuple[int, int]:
        """(transposed, direct) fragment loads from threadgroup memory."""
        b8, h8, c8 = self.block // 8, self.HD // 8 // self.split, self.chunk // 8 // self.split
        if self.kind == "fwd":
            return b8 * h8, c8 * b8
        return 2 * b8 * h8, (1 if self.kind == "dq" else 2) * c8 * b8

    def useful_mma(self) -> float:
        """Products a step needs once: recomputation for column chunks excluded."""
        b8, h8, c8 = self.block // 8, self.HD // 8 // self.split, self.chunk // 8 // self.split
        share = self.chunk / self.HD
        if self.kind == "fwd":
            return b8 * h8 * share + c8 * b8
        if self.kind == "dq":
            return 2 * b8 * h8 * share + c8 * b8
        return 2 * b8 * h8 * share + 2 * c8 * b8

    # -- issue slots of one step, per SIMD group ---------------------------
    def slots(self, chip: Chip) -> float:
        e = elem_bytes(self.dtype)
        b8, h8 = self.block // 8, self.HD // 8
        per_lane = self.block // 4  # score elements a lane holds
        s = self.mma() * MMA_SLOTS
        transposed, direct = self.fragment_loads()
        if self.dtype == "f32" or self.frag16:
            s += 2 * transposed + direct          # simdgroup_load: two lane loads transposed
        else:                                      # two element loads + two widenings
            widen = chip.bf16_widen_slots if self.dtype == "bf16" else 1
            s += (transposed + direct) * 2 * (1 + widen)
        if not self.resident:                      # operand rows reloaded from device per use
            uses = b8 * h8 * (1 if self.kind == "fwd" else 2) // self.split
            s += uses * 6
        if self.split > 1:                         # the pair's partial S^T, dP^T: store, load, add
            s += 2 * per_lane * 3
        # element-wise work on the lane's scores
        if self.kind == "fwd":
            s += per_lane * (4 + EXP2_SLOTS) + 4 * SHUFFLE_SLOTS + 8 + EXP2_SLOTS + self.chunk // 4
        elif self.kind == "dq":
            s += per_lane * (5 + EXP2_SLOTS)
        else:
            s += per_lane * (7 + EXP2_SLOTS)      # lse and delta read from threadgroup memory
        if self.dtype != "f32" and not self.frag16 and self.kind == "dkdv":
            s += transposed // 2 * 2              # q fragments times the scale
        if self.dtype != "f32" and self.frag16:
            s += per_lane                          # scale times S (16-bit: q is not pre-scaled)
            if self.p_half:
                s += per_lane // 2                 # P (and dS) to the 16-bit type, two at a time
        s += per_lane * (self.s_partials - 1)      # adding the partial sums of S
        # staging: this SIMD group's share of the two tiles
        elems = 2 * self.block * self.HD / self.simdgroups / 32  # per lane
        if self.copy16:
            s += elems * e / 16 * 6                # a 16-byte load, a store, index and guard
        else:                                      # per element: load, convert, scale, store, isfinite
            per4 = {"f32": 19, "f16": 27, "bf16": 22 + 4 * chip.bf16_round_slots}[self.dtype]
            s += elems / 4 * per4 + 15             # + the non-finite flags' reduction
        return s

    # -- bytes of one step, per threadgroup --------------------------------
    def tg_traffic(self) -> float:
        e = elem_bytes(self.dtype)
        transposed, direct = self.fragment_loads()
        loads = self.simdgroups * (transposed + direct) * 64 * e
        stores = 2 * self.block * self.HD * e
        if self.split > 1:                          # the pairs' exchange, stored and loaded
            stores += 2 * self.threads * self.block // 2 * 4
        return loads + stores

    def device_traffic(self) -> float:
        e = elem_bytes(self.dtype)
        staged = 2 * self.block * self.HD * e
        if not self.resident:
            b8, h8 = self.block // 8, self.HD // 8
            uses = b8 * h8 * (1 if self.kind == "fwd" else 2) // self.split
            staged += self.simdgroups * uses * 64 * e
        return staged

    def resident_threadgroups(self, chip: Chip) -> int:
        by_tg = chip.tg_memory_bytes // self.tg_bytes()
        by_threads = chip.max_threads // self.threads
        by_regs = chip.register_bytes // (self.threads * self.registers * 4)
        return max(1, min(by_tg, by_threads, by_regs if chip.registers_limit_occupancy else by_tg))

    def barriers(self) -> int:
        """Per step: stage, then release the tiles; a split pair's exchange."""
        return 2 + (self.split > 1)

    def end_barriers(self) -> int:
        """Per threadgroup, outside the steps (predicted_counts only): the
        forward's vote on its exact pass (fa_leaked); the dK/dV pairs'
        stores of dK and dV through the staged tiles, two each
        (fa_pair_store_rows)."""
        if self.kind == "fwd":
            return 1
        return 4 if self.kind == "dkdv" and self.split > 1 else 0

    def step_cycles(self, chip: Chip) -> float:
        alu = self.simdgroups * self.slots(chip) / 4
        if self.resident_threadgroups(chip) == 1:
            alu += self.barriers() * BARRIER_STALL
        return max(alu, self.tg_traffic() / chip.tg_bytes_per_cycle,
                   self.device_traffic() / chip.l2_bytes_per_cycle)

    def useful_flops(self) -> float:
        return self.simdgroups * self.useful_mma() * 1024

    def alu_share(self, chip: Chip) -> float:
        """The model's share of the ALU peak for long sequences, no mask."""
        return self.useful_flops() / (self.step_cycles(chip) * FLOPS_PER_CORE_CYCLE)


# ------------------------------------------------- the kernels, before and after
# "before": the kernels of commit 9063bbb (the NaN fix on issue 30's first
# day; the tile loops as issue 15 left them): float fragments (a 16-bit tile
# read element by element and widened), staging that converts, scales and
# tests every element, operand rows reloaded from device memory where they
# did not fit (dQ from hd96, dK/dV from hd64), dK/dV in two column chunks at
# hd128, delta by a preprocess kernel. Registers: the gate's table of that
# commit (docs/gpu-gate.md, the highest over the constant sets).
BEFORE_REGISTERS = {
    ("fwd", 64): (102, 98, 98), ("fwd", 128): (128, 127, 126),
    ("dq", 64): (124, 124, 124), ("dq", 128): (128, 128, 128),
    ("dkdv", 64): (128, 128, 128), ("dkdv", 128): (128, 122, 121),
}
DTYPES = ("f32", "f16", "bf16")


def before(kind: str, HD: int, dtype: str) -> Kernel:
    stage = 32 if HD <= 64 else 16 if HD <= 128 else 8
    if kind == "dkdv":
        block = 32 if HD <= 32 else min(stage, 16)
        chunk = HD if HD <= 96 else 64
        resident = HD <= 32
    elif kind == "dq":
        block, chunk, resident = stage, HD if HD <= 128 else 64, HD <= 64
    else:
        block, chunk, resident = stage, HD if HD <= 128 else 128, HD <= 128
    return Kernel(kind, HD, dtype, block, chunk, 4, resident, frag16=False, copy16=False,
                  s_partials=1, p_half=False, delta_mma=False,
                  registers=BEFORE_REGISTERS[(kind, HD)][DTYPES.index(dtype)])


# "after": the kernels as they are now (issue 30): staging moves 16-byte
# vectors as they are (9db780c), one at a time per thread, 16-bit operand
# fragments loaded by simdgroup_load, P (and bfloat16's dS) rounded to the
# 16-bit type, S (and dP) summed over D in two partial sums, rows padded by
# 16 bytes; block sizes and which rows stay in registers by dtype and head
# size as the GPU resource gate lets them (shaders/flash_kernels.h: dQ
# stages 16 keys at float32 hd64; the float32 forward reloads Q at hd128);
# the backward's non-finite check is a per-tile select on the raw scores
# (no second pass, no vote: no extra barrier); dK/dV in SIMD-group pairs
# (FA_DKDV_SPLIT: hd96, hd128), each half of D, 8 queries a step, adding
# their partial S^T and dP^T through threadgroup memory (one more barrier a
# step, and dK and dV stored through the staged tiles at the end): no
# column chunks at hd128; dK/dV's K and V in registers at every head size
# up to 128 (hd64 one SIMD group per 8 keys);
# dQ in pairs at hd96 and hd128 (FA_DQ_SPLIT), Q and dO in registers.
# Registers: the gate's table (docs/gpu-gate.md), the highest over the
# constant sets.
AFTER_REGISTERS = {
    ("fwd", 64): (116, 96, 98), ("fwd", 128): (122, 128, 128),
    ("dq", 64): (117, 117, 117), ("dq", 128): (128, 103, 104),
    ("dkdv", 64): (128, 128, 128), ("dkdv", 128): (128, 116, 117),
}


def after(kind: str, HD: int, dtype: str) -> Kernel:
    k = before(kind, HD, dtype)
    f32 = dtype == "f32"
    if kind == "fwd":
        k = dataclasses.replace(k, resident=HD <= (64 if f32 else 128))
    elif kind == "dq" and HD == 64 and f32:
        k = dataclasses.replace(k, block=16)
    elif kind == "dq" and 96 <= HD <= 128:
        # SIMD-group pairs (FA_DQ_SPLIT): Q, dO and dQ halves in registers
        k = dataclasses.replace(k, split=2, resident=True)
    elif kind == "dkdv" and 96 <= HD <= 128:
        # SIMD-group pairs, each half of D, 8 queries a step (FA_DKDV_SPLIT):
        # no column chunks; K and V in registers
        k = dataclasses.replace(k, split=2, block=8, chunk=HD, resident=True)
    elif kind == "dkdv" and HD == 64:
        # one SIMD group per 8 keys, 16 queries a step, K and V in registers
        # (FA_DKDV_ROWS_IN_REGISTERS)
        k = dataclasses.replace(k, resident=True)
    return dataclasses.replace(k, frag16=not f32, copy16=True, s_partials=2,
                               p_half=not f32, pad=16 // elem_bytes(dtype),
                               registers=AFTER_REGISTERS[(kind, HD)][DTYPES.index(dtype)])


KINDS = ("fwd", "dq", "dkdv")
VARIANTS = {"before": before, "after": after}


# ------------------------------------------- the counts, against metal-sim's
def predicted_counts(k: Kernel, T: int) -> dict:
    """What metal-sim counts for one launch of k over B = 1, H = Hkv = 1, Tq =
    Tk = T (a multiple of 32), no mask, finite inputs: the loop's matrix
    operations and fragment loads per SIMD group and step, times the SIMD
    groups, steps, row blocks and column chunks; two barriers a step (stage,
    then release the tiles), and after 9db780c one more per threadgroup (the
    SIMD groups' vote on the forward's exact pass, fa_leaked: the "before"
    kernels, 9063bbb, had none, and the backward's has none since its
    per-tile select); the dK/dV pairs' four at the end (dK and dV stored
    through the staged tiles, fa_pair_store_rows)."""
    row_blocks = T // k.rows
    steps = T // k.block
    chunks = k.HD // k.chunk
    launches = row_blocks * chunks * steps
    transposed, direct = k.fragment_loads()
    return {"mma": launches * k.simdgroups * k.mma(),
            "matrix_loads": launches * k.simdgroups * (transposed + direct),
            "barriers": launches * k.barriers() + row_blocks * chunks * k.end_barriers()}


def simulated_counts(HD: int, dtype: str, T: int = 64) -> dict:
    """metal-sim's counts per kernel host name for one forward and one
    backward call (B = 1, H = 1, D = HD, non-causal)."""
    import numpy as np
    import flashattn as fa
    from flashattn import _core
    np_dtype = {"f32": np.float32, "f16": np.float16}.get(dtype)
    if np_dtype is None:
        import ml_dtypes
        np_dtype = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, T, 1, HD), dtype=np.float32).astype(np_dtype)
                   for _ in range(4))
    _core._sim_reset_op_counts()
    o, lse = fa.attention(q, k, v, return_lse=True, backend="metal-sim")
    fa.attention_backward(do, q, k, v, o, lse, backend="metal-sim")
    return _core._sim_op_counts(True)


def check(T: int = 64, out=sys.stdout) -> int:
    """Compares the after-model's counts with metal-sim's running the
    kernels in shaders/; returns the number of mismatches."""
    names = {"fwd": "flash_fwd_{dt}_hd{hd}", "dq": "flash_bwd_dq_{dt}_hd{hd}",
             "dkdv": "flash_bwd_dkdv_{dt}_hd{hd}"}
    bad = 0
    for HD in (64, 128):
        for dtype in DTYPES:
            sim = simulated_counts(HD, dtype, T)
            for kind in KINDS:
                name = names[kind].format(dt=dtype, hd=HD)
                want = predicted_counts(after(kind, HD, dtype), T)
                got = sim.get(name)
                if got is None:
                    print(f"{name}: not launched (launched: {sorted(sim)})", file=out)
                    bad += 1
                    continue
                for key, value in want.items():
                    ok = got[key] == value
                    bad += not ok
                    print(f"{name:28s} {key:13s} model {value:7d}  metal-sim {got[key]:7d}"
                          f"{'' if ok else '  MISMATCH'}", file=out)
    return bad


def fwd_bwd_share(make, HD: int, dtype: str, chip: Chip) -> float:
    """Forward + backward over a long sequence (T x T, no mask): the
    standard 14 T^2 D FLOPs (forward 4, backward 10: FlashAttention's count;
    the dQ / dK/dV split computes 14 in the backward) over the three
    kernels' time. The delta preprocess is O(T D): left out."""
    cycles = 0.0
    for kind in KINDS:
        k = make(kind, HD, dtype)
        steps = (1 / k.rows) * (1 / k.block) * (HD / k.chunk)  # per T^2 rows x keys
        cycles += steps * k.step_cycles(chip)
    return 14 * HD / (cycles * FLOPS_PER_CORE_CYCLE)


def table(variants, heads=(64, 128)) -> str:
    """Markdown: share of the ALU peak per kernel, D, dtype and chip."""
    head = "| kernel | D | dtype | " + " | ".join(
        f"{c.name} {v}" for c in CHIPS for v in variants) + " |"
    lines = [head, "| " + " | ".join(["---"] * (3 + len(CHIPS) * len(variants))) + " |"]
    for kind in KINDS + ("fwd+bwd",):
        for HD in heads:
            for dtype in DTYPES:
                cells = []
                for chip in CHIPS:
                    for make in variants.values():
                        share = (fwd_bwd_share(make, HD, dtype, chip) if kind == "fwd+bwd"
                                 else make(kind, HD, dtype).alu_share(chip))
                        cells.append(f"{100 * share:.0f} %")
                name = {"fwd": "forward", "dq": "dQ", "dkdv": "dK/dV"}.get(kind, kind)
                lines.append(f"| {name} | {HD} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare the model's operation counts with metal-sim's")
    args = ap.parse_args(argv)
    if args.check:
        return 1 if check() else 0
    print(table(VARIANTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
