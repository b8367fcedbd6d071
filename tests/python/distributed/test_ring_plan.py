"""Ring attention's bookkeeping without MPI (flashattn/distributed/_plan.py): the
layouts' segments, and the per-pair sub-block and local window, checked
against the global mask of fa.reference.visible_keys, then a ring computed in
one process from those blocks against fa.attention / fa.attention_backward."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import flashattn as fa
from flashattn.distributed import _plan as plan
from flashattn.reference import visible_keys

BANDS = [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0)), (True, (3, 7)),
         (False, (6, 2)), (False, (-1, 4)), (False, (0, -1)), (False, (0, 0)),
         (False, (2, 0)), (True, (0, 0)), (False, (40, 40)), (True, (200, -1))]


def _random_lengths(rng, total, parts):
    cuts = np.sort(rng.integers(0, total + 1, parts - 1))
    return list(np.diff(np.concatenate([[0], cuts, [total]])).astype(int))


@pytest.mark.parametrize("causal, window", BANDS)
def test_pair_blocks_give_the_global_mask(causal, window):
    """For random segment pairs (uneven, empty, Tq != Tk), the union of the
    local masks of the planned blocks, placed where they sit, is the global
    mask's slice; a skipped pair's slice is all False."""
    rng = np.random.default_rng(sum(map(ord, repr((causal, window)))))
    for _ in range(60):
        Tq, Tk = int(rng.integers(1, 40)), int(rng.integers(1, 40))
        want = visible_keys(Tq, Tk, causal=causal, window=window)
        band = plan.global_band(Tq, Tk, causal, window)
        qs, ks = sorted(rng.integers(0, Tq + 1, 2)), sorted(rng.integers(0, Tk + 1, 2))
        qs, nq, ks, nk = int(qs[0]), int(qs[1] - qs[0]), int(ks[0]), int(ks[1] - ks[0])
        got = np.zeros((nq, nk), bool)
        blk = plan.pair_block(qs, nq, ks, nk, Tq, Tk, band)
        if blk is not None:
            left, right = blk.window
            assert left >= -1 and right >= -1
            got[blk.a0:blk.a1, blk.b0:blk.b1] = visible_keys(
                blk.a1 - blk.a0, blk.b1 - blk.b0, window=blk.window)
        np.testing.assert_array_equal(got, want[qs:qs + nq, ks:ks + nk],
                                      err_msg=f"Tq={Tq} Tk={Tk} q[{qs}:+{nq}] k[{ks}:+{nk}] {blk}")


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("total", [0, 1, 7, 48, 61])
def test_layouts_cover_the_sequence_once(size, total):
    rng = np.random.default_rng(total * 10 + size)
    for layout in plan.LAYOUTS:
        if layout == "zigzag":
            lengths = [plan.zigzag_length(total, size, r) for r in range(size)]
            plan.check_lengths("t", "q", layout, lengths)
        else:
            lengths = _random_lengths(rng, total, size)
        rows = []
        for r in range(size):
            segs = plan.segments(layout, lengths, r)
            assert sum(s.length for s in segs) == lengths[r]
            for s in segs:
                rows += range(s.start, s.start + s.length)
        assert sorted(rows) == list(range(total))
        if layout == "zigzag":
            # the chunks numpy.array_split makes, r and 2P - 1 - r on rank r
            chunks = np.array_split(np.arange(total), 2 * size)
            for r in range(size):
                want = np.concatenate([chunks[r], chunks[2 * size - 1 - r]])
                got = np.concatenate([np.arange(s.start, s.start + s.length)
                                      for s in plan.segments(layout, lengths, r)])
                np.testing.assert_array_equal(got, want)


def test_zigzag_lengths_are_checked():
    with pytest.raises(ValueError,
                       match=r"ring_attention: layout='zigzag' .* got q shard lengths \[6, 4\]"):
        # 10 rows in 4 chunks of 3, 3, 2, 2: rank 0 holds 3 + 2, rank 1 3 + 2
        plan.check_lengths("ring_attention", "q", "zigzag", [6, 4])


def test_bad_layout_names_the_value():
    with pytest.raises(ValueError, match=r"ring_attention: layout must be one of .*'ring'"):
        plan.check_layout("ring_attention", "ring")


def _ring_in_one_process(q, k, v, do, q_len, kv_len, layout, causal, window):
    """The ring's arithmetic without MPI: every (rank, step) block planned,
    merged with fa.merge_states, gradients added (what flashattn.distributed does)."""
    size = len(q_len)
    Tq, Tk = q.shape[1], k.shape[1]
    band = plan.global_band(Tq, Tk, causal, window)
    qsegs = [plan.segments(layout, q_len, r) for r in range(size)]
    ksegs = [plan.segments(layout, kv_len, r) for r in range(size)]

    def rows(segs, x):
        return np.concatenate([x[:, s.start:s.start + s.length] for s in segs], axis=1)

    o = np.zeros(q.shape, np.float32)
    lse = np.full((q.shape[0], q.shape[2], Tq), -np.inf, np.float32)
    grads = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
    o_loc, lse_loc = [], []
    for r in range(size):
        ql = rows(qsegs[r], q)
        o_r = np.zeros(ql.shape, np.float32)
        lse_r = np.full((q.shape[0], q.shape[2], ql.shape[1]), -np.inf, np.float32)
        for src in range(size):
            kl, vl = rows(ksegs[src], k), rows(ksegs[src], v)
            for r0, r1, k0, k1, w in plan.blocks(qsegs[r], ksegs[src], Tq, Tk, band):
                op, lp = fa.attention(ql[:, r0:r1], kl[:, k0:k1], vl[:, k0:k1], window=w,
                                      return_lse=True)
                o_r[:, r0:r1], lse_r[..., r0:r1] = fa.merge_states(
                    [o_r[:, r0:r1], op], [lse_r[..., r0:r1], lp])
        o_loc.append(o_r)
        lse_loc.append(lse_r)
    for r in range(size):
        off = 0
        for s in qsegs[r]:
            o[:, s.start:s.start + s.length] = o_loc[r][:, off:off + s.length]
            lse[..., s.start:s.start + s.length] = lse_loc[r][..., off:off + s.length]
            off += s.length
    # backward: each block's gradients with the global o and lse
    for r, src in itertools.product(range(size), range(size)):
        ql, dol, ol = rows(qsegs[r], q), rows(qsegs[r], do), rows(qsegs[r], o)
        lsel = np.concatenate([lse[..., s.start:s.start + s.length] for s in qsegs[r]], axis=-1)
        kl, vl = rows(ksegs[src], k), rows(ksegs[src], v)
        qmap = np.concatenate([np.arange(s.start, s.start + s.length) for s in qsegs[r]])
        kmap = np.concatenate([np.arange(s.start, s.start + s.length) for s in ksegs[src]])
        for r0, r1, k0, k1, w in plan.blocks(qsegs[r], ksegs[src], Tq, Tk, band):
            dq, dk, dv = fa.attention_backward(
                dol[:, r0:r1], ql[:, r0:r1], kl[:, k0:k1], vl[:, k0:k1], ol[:, r0:r1],
                np.ascontiguousarray(lsel[..., r0:r1]), window=w)
            grads[0][:, qmap[r0:r1]] += dq
            grads[1][:, kmap[k0:k1]] += dk
            grads[2][:, kmap[k0:k1]] += dv
    return o, lse, grads


@pytest.mark.parametrize("layout", plan.LAYOUTS)
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (6, 0)),
                                            (False, (5, 9))])
def test_blocks_merged_equal_one_call(layout, causal, window):
    """The blocks of 3 ranks, merged and summed in one process, equal one
    engine call on the whole sequence (to float32 rounding); Tq != Tk."""
    rng = np.random.default_rng(3)
    B, Tq, Tk, H, Hkv, D = 2, 37, 45, 4, 2, 16
    q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    k, v = (rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape, dtype=np.float32)
    if layout == "zigzag":
        q_len = [plan.zigzag_length(Tq, 3, r) for r in range(3)]
        kv_len = [plan.zigzag_length(Tk, 3, r) for r in range(3)]
    else:
        q_len, kv_len = [20, 0, 17], [5, 30, 10]
    o, lse, grads = _ring_in_one_process(q, k, v, do, q_len, kv_len, layout, causal, window)
    opts = dict(causal=causal, window=window)
    o1, lse1 = fa.attention(q, k, v, return_lse=True, **opts)
    np.testing.assert_allclose(o, o1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse1))
    np.testing.assert_allclose(lse, lse1, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, fa.attention_backward(do, q, k, v, o1, lse1, **opts)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_zigzag_balances_causal_work(size):
    """With layout='zigzag' and causal masking, every rank makes the same
    number of engine calls over the same number of (row, key) pairs; with
    'contiguous', the last rank has P times the first's."""
    T = 2 * size * 16
    band = plan.global_band(T, T, True, (-1, -1))

    def work(layout):
        lengths = ([plan.zigzag_length(T, size, r) for r in range(size)] if layout == "zigzag"
                   else [T // size] * size)
        per_rank = []
        for r in range(size):
            calls = [blk for src in range(size)
                     for blk in plan.blocks(plan.segments(layout, lengths, r),
                                            plan.segments(layout, lengths, src), T, T, band)]
            per_rank.append((len(calls), sum((r1 - r0) * (k1 - k0) for r0, r1, k0, k1, _ in calls)))
        return per_rank

    zigzag = work("zigzag")
    assert len(set(zigzag)) == 1, zigzag
    contiguous = work("contiguous")
    assert [n for n, _ in contiguous] == list(range(1, size + 1)), contiguous
