"""Ring attention's bookkeeping, free of MPI: where each rank's shard sits in
the global sequence (the layouts), and, for one pair (a local query segment,
a key/value segment of some rank), which sub-block of rows and keys the
causal/window band reaches and which local ``window=`` makes the engines'
bottom-right alignment give exactly the global band there.

The engines place query row a of a (nq, nk) call at key position
a + nk - nq. Globally, query i sits at i + Tk - Tq. A pair whose query
segment starts at global row qs and whose key segment starts at global key
ks therefore needs its local window shifted by the difference of the two
alignments; cutting the pair down to the rows and keys the band reaches
makes that shifted window non-negative on each bounded side (see
``pair_block``), so every pair is one ordinary engine call.
"""

from __future__ import annotations

import dataclasses

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows [start, start + length) of the global sequence, held at
    [local, local + length) of the rank's shard."""

    start: int
    length: int
    local: int


def check_layout(fn: str, layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def zigzag_chunks(total: int, size: int) -> list[tuple[int, int]]:
    """(start, length) of the 2·size chunks of ``total`` rows, split as
    numpy.array_split splits: the first total % (2·size) chunks one longer."""
    n = 2 * size
    base, extra = divmod(total, n)
    chunks, start = [], 0
    for c in range(n):
        length = base + (1 if c < extra else 0)
        chunks.append((start, length))
        start += length
    return chunks


def zigzag_length(total: int, size: int, rank: int) -> int:
    chunks = zigzag_chunks(total, size)
    return chunks[rank][1] + chunks[2 * size - 1 - rank][1]


def segments(layout: str, lengths: list[int], rank: int) -> list[Segment]:
    """The global rows of ``rank``'s shard, given every rank's shard length.

    contiguous: rank r holds the r-th run of rows, of any length.
    zigzag: rank r holds chunks r and 2P - 1 - r of 2P; lengths must be
    those numpy.array_split gives (``check_lengths`` says so first).
    """
    if layout == "contiguous":
        return [Segment(sum(lengths[:rank]), lengths[rank], 0)]
    size = len(lengths)
    chunks = zigzag_chunks(sum(lengths), size)
    (s0, n0), (s1, n1) = chunks[rank], chunks[2 * size - 1 - rank]
    return [Segment(s0, n0, 0), Segment(s1, n1, n0)]


def check_lengths(fn: str, name: str, layout: str, lengths: list[int]) -> None:
    """zigzag shards must be the chunks fd.shard makes; contiguous ones may be
    any lengths."""
    if layout != "zigzag":
        return
    total, size = sum(lengths), len(lengths)
    want = [zigzag_length(total, size, r) for r in range(size)]
    if lengths != want:
        raise ValueError(
            f"{fn}: layout='zigzag' needs rank r to hold chunks r and {2 * size - 1}-r of the "
            f"{2 * size} chunks numpy.array_split makes of the {total} rows ({name} shard lengths "
            f"{want} on ranks 0..{size - 1}); got {name} shard lengths {lengths}. "
            "Make the shards with fd.shard(x, layout='zigzag')"
        )


def global_band(Tq: int, Tk: int, causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """(left, right) over the global sequence, -1 for an unbounded side;
    causal caps right at 0, and a side that reaches past every key is
    unbounded (as the engines treat it)."""
    left, right = window
    if causal:
        right = 0
    reach = Tq + Tk  # past every key from every query position
    left = -1 if left < 0 or left >= reach else left
    right = -1 if right < 0 or right >= reach else right
    return left, right


@dataclasses.dataclass(frozen=True)
class Block:
    """One engine call of a pair: query rows [a0, a1) of the query segment
    against keys [b0, b1) of the key segment, with this local window."""

    a0: int
    a1: int
    b0: int
    b1: int
    window: tuple[int, int]


def pair_block(qs: int, nq: int, ks: int, nk: int, Tq: int, Tk: int,
               band: tuple[int, int]) -> Block | None:
    """The sub-block of a (query segment, key segment) pair that the global
    band reaches, or None when it reaches none of it (the pair is skipped).

    Query row a of the segment (global row qs + a) sits at global key
    position qs + a + Tk - Tq, that is at s + a in the segment's keys, with
    s = qs + Tk - Tq - ks; it sees keys s + a - left <= b <= s + a + right.
    Rows that see a key are a0 <= a < a1; the keys they see are b0 <= b < b1.
    In the call on that sub-block the engine puts row a at key position
    a + c (c = nk' - nq'), so the local window is left' = left - (s' - c),
    right' = right + (s' - c), s' = s + a0 - b0. Both are >= 0: the last
    row sees a key (so left' >= 0), and the last key is seen by a row (so
    right' >= 0).
    """
    left, right = band
    if nq <= 0 or nk <= 0:
        return None
    s = qs + Tk - Tq - ks
    a0, a1 = 0, nq
    if right >= 0:
        a0 = max(a0, -s - right)  # rows before this see only keys before the segment
    if left >= 0:
        a1 = min(a1, nk - s + left)  # rows from here on see only keys after it
    if a0 >= a1:
        return None
    b0 = max(0, a0 + s - left) if left >= 0 else 0
    b1 = min(nk, a1 + s + right) if right >= 0 else nk
    s2 = s + a0 - b0
    c = (b1 - b0) - (a1 - a0)
    local_left = left - (s2 - c) if left >= 0 else -1
    local_right = right + (s2 - c) if right >= 0 else -1
    assert local_left >= -1 and local_right >= -1 and b0 < b1, (qs, nq, ks, nk, Tq, Tk, band)
    return Block(a0, a1, b0, b1, (local_left, local_right))


def blocks(q_segments: list[Segment], kv_segments: list[Segment], Tq: int, Tk: int,
           band: tuple[int, int]) -> list[tuple[int, int, int, int, tuple[int, int]]]:
    """Every engine call of one ring step: (local rows r0, r1 of the query
    shard, local keys k0, k1 of the key/value shard, local window); pairs the
    band does not reach are left out."""
    calls = []
    for qseg in q_segments:
        for kseg in kv_segments:
            blk = pair_block(qseg.start, qseg.length, kseg.start, kseg.length, Tq, Tk, band)
            if blk is not None:
                calls.append((qseg.local + blk.a0, qseg.local + blk.a1,
                              kseg.local + blk.b0, kseg.local + blk.b1, blk.window))
    return calls
