"""fa.attention_varlen and its backward on every engine: packed sequences of
different lengths (empty ones too), against fa.reference.attention_varlen
by the accuracy rule, with causal (bottom-right per sequence), windows, GQA,
the score options, and the prefix sums' errors."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn as fa
from helpers import FORWARD_FACTOR, GRADIENT_FACTOR, _max_abs, assert_close_to_reference

# (lengths of q, lengths of k) per sequence: decode-like, Tq > Tk, empty ones.
LAYOUTS = {
    "mixed": ([7, 1, 40, 0, 13], [7, 30, 40, 5, 2]),
    "empty-keys": ([3, 4], [0, 9]),
    "one": ([65], [130]),
    # Decoding against long caches: alone, each would split its keys (split-KV).
    "decode": ([1, 1, 2, 1], [1500, 700, 1100, 64]),
}
OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(5, 2)),
    "causal-softcap-alibi-sinks": dict(causal=True, softcap=3.0, alibi="BH", sinks=True),
    "alibi-H": dict(alibi="H"),
}


def make(layout, H=4, Hkv=2, D=48, seed=50):
    lens_q, lens_k = LAYOUTS[layout]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((cu_q[-1], H, D), dtype=np.float32)
    k, v = (rng.standard_normal((cu_k[-1], Hkv, D), dtype=np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape, dtype=np.float32)
    return q, k, v, do, cu_q, cu_k


def options(name, batch, H, seed=51):
    opts = dict(OPTIONS[name])
    rng = np.random.default_rng(seed)
    alibi = opts.pop("alibi", None)
    if alibi == "H":
        opts["alibi_slopes"] = rng.uniform(0.05, 0.3, H).astype(np.float32)
    elif alibi == "BH":
        opts["alibi_slopes"] = rng.uniform(0.05, 0.3, (batch, H)).astype(np.float32)
    if opts.pop("sinks", False):
        opts["sinks"] = rng.standard_normal(H).astype(np.float32)
    return opts


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_varlen_matches_reference(backend, layout, option):
    q, k, v, do, cu_q, cu_k = make(layout)
    opts = options(option, len(cu_q) - 1, q.shape[1])
    o, lse = fa.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend=backend, **opts)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    o64, lse64 = fa.reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    o32, lse32 = fa.reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True,
                                               dtype=np.float32, **opts)
    assert_close_to_reference(o, o64, o32, factor=FORWARD_FACTOR, backend=backend, name="o")
    assert_close_to_reference(lse, lse64, lse32, factor=FORWARD_FACTOR, backend=backend, name="lse")

    grads = fa.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, backend=backend, **opts)
    refs = fa.reference.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, **opts)
    bases = fa.reference.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k,
                                                   dtype=np.float32, **opts)
    assert len(grads) == len(refs)
    magnitude = max(_max_abs(r) for r in refs[:3])
    for name, got, ref, base in zip(("dq", "dk", "dv", "dsinks"), grads, refs, bases):
        assert_close_to_reference(got, ref, base, factor=GRADIENT_FACTOR, backend=backend,
                                  name=name, magnitude=None if name == "dsinks" else magnitude)


def test_varlen_is_the_per_sequence_call(backend):
    """Each sequence's rows are what fa.attention gives on that sequence
    alone, bit for bit: nothing crosses between sequences."""
    q, k, v, do, cu_q, cu_k = make("mixed")
    o, lse = fa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, backend=backend)
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            continue
        o_b, lse_b = fa.attention(q[None, rq], k[None, rk], v[None, rk], causal=True,
                                  return_lse=True, backend=backend)
        np.testing.assert_array_equal(o[rq], o_b[0])
        np.testing.assert_array_equal(lse[:, rq], lse_b[0])


def test_varlen_many_sequences_in_one_call(backend):
    """Many short sequences of awkward lengths (the case one call per
    sequence served worst), forward and backward, by the accuracy rule."""
    rng = np.random.default_rng(52)
    lens_q = rng.integers(1, 70, size=37)
    lens_k = lens_q + rng.integers(0, 9, size=37)  # Tk >= Tq: causal rows all see keys
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    H, Hkv, D = 3, 1, 40
    q = rng.standard_normal((cu_q[-1], H, D), dtype=np.float32)
    k, v = (rng.standard_normal((cu_k[-1], Hkv, D), dtype=np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape, dtype=np.float32)
    o, lse = fa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                 backend=backend)
    o64, lse64 = fa.reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    o32 = fa.reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, dtype=np.float32)
    assert_close_to_reference(o, o64, o32, factor=FORWARD_FACTOR, backend=backend, name="o")
    grads = fa.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, causal=True,
                                         backend=backend)
    refs = fa.reference.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, causal=True)
    bases = fa.reference.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, causal=True,
                                                   dtype=np.float32)
    magnitude = max(_max_abs(r) for r in refs)
    for name, got, ref, base in zip(("dq", "dk", "dv"), grads, refs, bases):
        assert_close_to_reference(got, ref, base, factor=GRADIENT_FACTOR, backend=backend,
                                  name=name, magnitude=magnitude)


def test_varlen_per_sequence_baseline_agrees(backend):
    """The per-sequence baseline the bench times (one engine call per
    sequence) gives the same forward bits as the one call where neither
    splits keys, and gradients by the accuracy rule."""
    from flashattn import _api

    q, k, v, do, cu_q, cu_k = make("mixed")
    args = (None, None, True, (-1, -1), None, 0.0, None, None, True, backend)
    o, lse = _api._attention_varlen(q, k, v, cu_q, cu_k, *args)
    o1, lse1 = _api._attention_varlen(q, k, v, cu_q, cu_k, *args, per_sequence=True)
    np.testing.assert_array_equal(o, o1)
    np.testing.assert_array_equal(lse, lse1)
    bargs = (None, None, True, (-1, -1), None, 0.0, None, None, backend)
    grads = _api._attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, *bargs)
    loop = _api._attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, *bargs,
                                           per_sequence=True)
    refs = fa.reference.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, causal=True)
    bases = fa.reference.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, causal=True,
                                                   dtype=np.float32)
    magnitude = max(_max_abs(r) for r in refs)
    for name, got, ref, base in zip(("dq", "dk", "dv") * 2, grads + loop, refs * 2, bases * 2):
        assert_close_to_reference(got, ref, base, factor=GRADIENT_FACTOR, backend=backend,
                                  name=name, magnitude=magnitude)


@pytest.mark.parametrize("cu,message", [
    ([0, 7, 8, 48, 48, 61, 61], r"cu_seqlens_q and cu_seqlens_k must have the same length"),
    ([1, 8, 48, 48, 61, 61], r"cu_seqlens_q\[0\] must be 0, got 1"),
    ([0, 7, 8, 48, 40, 61], r"cu_seqlens_q\[4\] = 40 < cu_seqlens_q\[3\] = 48"),
    ([0, 7, 8, 48, 48, 60], r"cu_seqlens_q\[5\] = 60 must equal the number of rows 61"),
])
def test_varlen_refuses_bad_prefix_sums(cu, message):
    q, k, v, do, cu_q, cu_k = make("mixed")
    with pytest.raises(ValueError, match=message):
        fa.attention_varlen(q, k, v, np.array(cu, np.int32), cu_k)


def test_varlen_refuses_other_dtypes_and_short_max_seqlen():
    q, k, v, do, cu_q, cu_k = make("mixed")
    with pytest.raises(TypeError, match=r"cu_seqlens_k must be int32 \(or integers that fit "
                                        r"it\), got float32"):
        fa.attention_varlen(q, k, v, cu_q, cu_k.astype(np.float32))
    too_big = cu_k.astype(np.int64)
    too_big[-1] += 2**32
    with pytest.raises(ValueError, match=rf"cu_seqlens_k must fit int32, got values from 0 to "
                                         rf"{too_big[-1]}"):
        fa.attention_varlen(q, k, v, cu_q, too_big)
    with pytest.raises(ValueError, match=r"max_seqlen_k = 39 is shorter than the longest sequence \(40\)"):
        fa.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_k=39)
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total_q, heads, D\)"):
        fa.attention_varlen(q[None], k, v, cu_q, cu_k)
    o, lse = fa.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=40, max_seqlen_k=40,
                                 return_lse=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(H, total_q\) = \(4, 61\)"):
        fa.attention_varlen_backward(do, q, k, v, o, lse.T, cu_q, cu_k)
