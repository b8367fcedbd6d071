"""`python -m flashattn bench options`: what the score options and
variable-length batches cost on the cpu engine (issue 16), with torch SDPA's
counterparts in the same run where it has them.

Options: one causal shape, plain attention against softcap, ALiBi, sinks, a
bool mask and a float (additive) mask, forward and forward + backward; the
cost is each one's minimum time over plain attention's minimum. torch SDPA
runs plain, with the same bool and additive masks, and with ALiBi as an
additive (H, T, T) bias (torch has no softcap or sinks in SDPA).

Varlen: a packed batch of sequences of different lengths against the same
sequences padded to the longest (B x T_max, what a fixed-shape kernel
computes); time per unit of sum T_b^2 shows the cost follows the real work.
Then a varlen call against a dense batch of the same work: 256 sequences
of 64 tokens (dense B = 256, T = 64), and 64 of mixed lengths 1..512 (dense
B = 64 sequences of the length whose causal work matches, compared per unit
of work), forward and forward + backward, the varlen batch run as one engine
call (what fa.attention_varlen does) and, beside it, as one engine call per
sequence (what it did before: each short sequence a parallel loop of its own).

Every timed call runs once to warm up, then --repeat times (at least 5),
the variants interleaved in alternating order; min (median) in ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from ..args import positive_int

OPTIONS_SHAPE = (1, 2048, 8, 8, 64)  # B, T, H, Hkv, D; causal
VARLEN_LENGTHS = [1536, 768, 384, 256, 128, 128, 64, 64, 32, 16]
VARLEN_HEADS = (8, 8, 64)  # H, Hkv, D
SHORT_BATCH = (256, 64)  # sequences, tokens each: issue 34's first varlen case
MIXED_BATCH = (64, 512)  # sequences, longest: lengths drawn from 1..512 (seeded)


def _interleaved(fns, repeat):
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    names = list(fns)
    for r in range(repeat):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def _fmt(ts):
    return f"{min(ts) * 1e3:9.2f} ({statistics.median(ts) * 1e3:8.2f})"


def options_section(repeat, torch):
    import flashattn as fa

    B, T, H, Hkv, D = OPTIONS_SHAPE
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, H, D), dtype=np.float32)
    k = rng.standard_normal((B, T, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((B, T, Hkv, D), dtype=np.float32)
    do = rng.standard_normal((B, T, H, D), dtype=np.float32)
    slopes = (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)  # ALiBi's geometric slopes
    causal = np.tril(np.ones((T, T), bool))
    bool_mask = causal & (rng.random((T, T)) < 0.9)
    float_mask = np.where(causal, rng.standard_normal((T, T)).astype(np.float32) * 0.1,
                          -np.inf).astype(np.float32)
    variants = {
        "plain": dict(causal=True),
        "softcap=30": dict(causal=True, softcap=30.0),
        "alibi (H,)": dict(causal=True, alibi_slopes=slopes),
        "sinks (H,)": dict(causal=True, sinks=np.zeros(H, np.float32)),
        "mask bool (T,T)": dict(causal=True, mask=bool_mask),
        "mask float (T,T)": dict(mask=float_mask),
    }

    def fwd(opts):
        return lambda: fa.attention(q, k, v, backend="cpu", **opts)

    def fwd_bwd(opts):
        def run():
            o, lse = fa.attention(q, k, v, return_lse=True, backend="cpu", **opts)
            fa.attention_backward(do, q, k, v, o, lse, backend="cpu", **opts)
        return run

    fns = {}
    for name, opts in variants.items():
        fns[("ours", "fwd", name)] = fwd(opts)
        fns[("ours", "fwd+bwd", name)] = fwd_bwd(opts)
    if torch is not None:
        def t(x):
            return torch.from_numpy(x).permute(0, 2, 1, 3).contiguous()

        tq, tk, tv, tdo = t(q), t(k), t(v), t(do)
        distance = np.abs(np.arange(T)[:, None] - np.arange(T)[None, :]).astype(np.float32)
        alibi_bias = np.where(causal, -slopes[:, None, None] * distance, -np.inf).astype(np.float32)
        torch_masks = {
            "plain": None,
            "alibi (H,)": torch.from_numpy(alibi_bias)[None],
            "mask bool (T,T)": torch.from_numpy(bool_mask),  # torch's bool: True = may attend, too
            "mask float (T,T)": torch.from_numpy(float_mask),
        }
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def torch_fwd(mask):
            def run():
                with torch.no_grad():
                    sdpa(tq, tk, tv, attn_mask=mask, is_causal=mask is None)
            return run

        def torch_fwd_bwd(mask):
            qg, kg, vg = (x.clone().requires_grad_() for x in (tq, tk, tv))

            def run():
                o = sdpa(qg, kg, vg, attn_mask=mask, is_causal=mask is None)
                torch.autograd.grad(o, (qg, kg, vg), tdo)
            return run

        for name, mask in torch_masks.items():
            fns[("torch", "fwd", name)] = torch_fwd(mask)
            fns[("torch", "fwd+bwd", name)] = torch_fwd_bwd(mask)
    names = list(fns)
    times = _interleaved({n: fns[n] for n in names}, repeat)

    print(f"\nscore options, cpu engine: B={B}, T={T}, H={H}, D={D}, causal; "
          f"min (median) ms of {repeat} interleaved runs; cost = min / plain's min")
    head = f"{'option':<18} {'pass':<8} {'flashattn ms':>20} {'cost':>7}"
    if torch is not None:
        head += f" {'torch SDPA ms':>20} {'torch / ours':>12}"
    print(head)
    print("-" * len(head))
    for kind in ("fwd", "fwd+bwd"):
        plain = min(times[("ours", kind, "plain")])
        for name in variants:
            ours = times[("ours", kind, name)]
            line = f"{name:<18} {kind:<8} {_fmt(ours)} {100 * (min(ours) / plain - 1):+6.1f}%"
            key = ("torch", kind, name)
            if key in times:
                line += f" {_fmt(times[key])} {min(times[key]) / min(ours):11.2f}x"
            print(line)
    if torch is not None:
        print("torch: plain is is_causal=True; alibi is an additive (1, H, T, T) causal bias; "
              "the bool and float masks the same (T, T) arrays")
    return times


def varlen_section(repeat):
    import flashattn as fa

    H, Hkv, D = VARLEN_HEADS
    rng = np.random.default_rng(1)

    def packed(lengths):
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        q = rng.standard_normal((cu[-1], H, D), dtype=np.float32)
        k = rng.standard_normal((cu[-1], Hkv, D), dtype=np.float32)
        v = rng.standard_normal((cu[-1], Hkv, D), dtype=np.float32)
        return cu, q, k, v

    skewed = VARLEN_LENGTHS
    equal = [int(np.sqrt(sum(t * t for t in skewed) / len(skewed)))] * len(skewed)  # same sum T^2
    cases = {"skewed": packed(skewed), "equal": packed(equal)}
    T_max = max(skewed)
    pq = rng.standard_normal((len(skewed), T_max, H, D), dtype=np.float32)
    pk = rng.standard_normal((len(skewed), T_max, Hkv, D), dtype=np.float32)
    pv = rng.standard_normal((len(skewed), T_max, Hkv, D), dtype=np.float32)
    fns = {name: (lambda c=c: fa.attention_varlen(c[1], c[2], c[3], c[0], c[0], causal=True,
                                                 backend="cpu"))
           for name, c in cases.items()}
    fns["padded"] = lambda: fa.attention(pq, pk, pv, causal=True, backend="cpu")
    times = _interleaved(fns, repeat)
    work = {"skewed": sum(t * t for t in skewed), "equal": sum(t * t for t in equal),
            "padded": len(skewed) * T_max * T_max}
    print(f"\nvarlen, cpu engine, causal forward: H={H}, D={D}; skewed lengths {skewed}; "
          f"'equal' has {len(equal)} sequences of {equal[0]} (the same sum T^2); "
          f"'padded' is the skewed batch padded to {T_max}")
    head = f"{'batch':<8} {'sum T_b^2':>12} {'ms':>20} {'ns per T^2':>11} {'time / skewed':>14}"
    print(head)
    print("-" * len(head))
    base = min(times["skewed"])
    for name in ("skewed", "equal", "padded"):
        ts = times[name]
        print(f"{name:<8} {work[name]:>12} {_fmt(ts)} {min(ts) / work[name] * 1e9:11.3f} "
              f"{min(ts) / base:13.2f}x")
    print(f"padded / skewed work ratio: {work['padded'] / work['skewed']:.2f}")
    return times


def _causal_work(lengths):
    """(query, key) pairs a causal call computes: sum of T (T + 1) / 2."""
    return sum(t * (t + 1) // 2 for t in lengths)


def one_launch_section(repeat):
    """A varlen call, in one engine call and in one per sequence, against a
    dense batch of the same work."""
    import flashattn as fa
    from flashattn import _api

    H, Hkv, D = VARLEN_HEADS
    rng = np.random.default_rng(2)
    n_mixed, longest = MIXED_BATCH
    mixed = [int(t) for t in rng.integers(1, longest + 1, size=n_mixed)]
    rms = int(round(np.sqrt(np.mean([t * (t + 1) for t in mixed]))))  # dense length, same work
    cases = {"256 x 64": ([SHORT_BATCH[1]] * SHORT_BATCH[0], (SHORT_BATCH[0], SHORT_BATCH[1])),
             f"mixed 1..{longest}": (mixed, (n_mixed, rms))}

    def arrays(shape_q, shape_kv):
        return (rng.standard_normal(shape_q, dtype=np.float32),
                rng.standard_normal(shape_kv, dtype=np.float32),
                rng.standard_normal(shape_kv, dtype=np.float32),
                rng.standard_normal(shape_q, dtype=np.float32))

    def passes(call, backward):
        def fwd():
            call(False)

        def fwd_bwd():
            backward(*call(True))
        return fwd, fwd_bwd

    fns, work = {}, {}
    for name, (lengths, (B, T)) in cases.items():
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        q, k, v, do = arrays((int(cu[-1]), H, D), (int(cu[-1]), Hkv, D))
        dq, dk, dv, ddo = arrays((B, T, H, D), (B, T, Hkv, D))

        def varlen(lse, q=q, k=k, v=v, cu=cu, per_sequence=False):
            return _api._attention_varlen(q, k, v, cu, cu, None, None, True, (-1, -1), None,
                                          0.0, None, None, lse, "cpu", per_sequence)

        def varlen_bwd(o, lse, q=q, k=k, v=v, cu=cu, do=do, per_sequence=False):
            _api._attention_varlen_backward(do, q, k, v, o, lse, cu, cu, None, None, True,
                                            (-1, -1), None, 0.0, None, None, "cpu",
                                            per_sequence)

        def loop(lse, varlen=varlen):
            return varlen(lse, per_sequence=True)

        def loop_bwd(o, lse, varlen_bwd=varlen_bwd):
            varlen_bwd(o, lse, per_sequence=True)

        def dense(lse, q=dq, k=dk, v=dv):
            return fa.attention(q, k, v, causal=True, return_lse=lse, backend="cpu")

        def dense_bwd(o, lse, q=dq, k=dk, v=dv, do=ddo):
            fa.attention_backward(do, q, k, v, o, lse, causal=True, backend="cpu")

        for kind, f in zip(("fwd", "fwd+bwd"), passes(varlen, varlen_bwd)):
            fns[(name, kind, "varlen")] = f
        for kind, f in zip(("fwd", "fwd+bwd"), passes(loop, loop_bwd)):
            fns[(name, kind, "per sequence")] = f
        for kind, f in zip(("fwd", "fwd+bwd"), passes(dense, dense_bwd)):
            fns[(name, kind, "dense")] = f
        work[(name, "varlen")] = _causal_work(lengths)
        work[(name, "dense")] = B * _causal_work([T])
    times = _interleaved(fns, repeat)

    print(f"\nvarlen in one call against a dense batch of the same work, cpu engine, causal: "
          f"H={H}, Hkv={Hkv}, D={D}; mixed: {n_mixed} lengths drawn from 1..{longest} (seed 2), "
          f"dense {n_mixed} x {rms} (the same sum T (T + 1) / 2 to within rounding)")
    print("varlen / dense: each one's time per unit of work (sum T (T + 1) / 2), as a ratio")
    head = (f"{'batch':<16} {'pass':<8} {'dense':>9} {'ms':>20} {'one call ms':>20} "
            f"{'/ dense':>8} {'per sequence ms':>20} {'/ dense':>8}")
    print(head)
    print("-" * len(head))
    for name, (lengths, (B, T)) in cases.items():
        for kind in ("fwd", "fwd+bwd"):
            td = times[(name, kind, "dense")]
            line = f"{name:<16} {kind:<8} {f'{B}x{T}':>9} {_fmt(td)}"
            for variant in ("varlen", "per sequence"):
                tv = times[(name, kind, variant)]
                ratio = (min(tv) / work[(name, "varlen")]) / (min(td) / work[(name, "dense")])
                line += f" {_fmt(tv)} {ratio:7.2f}x"
            print(line)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashattn bench options",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=positive_int, default=5, help="timed runs (>= 5)")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--only", choices=("options", "varlen", "one-launch"), default=None)
    args = parser.parse_args(argv)
    if args.repeat < 5:
        parser.error("--repeat must be at least 5")
    import flashattn as fa

    if args.threads:
        fa.set_num_threads(args.threads)
    try:
        import torch

        torch.set_num_threads(fa.get_num_threads())
        note = f"torch {torch.__version__}"
    except ImportError:
        torch, note = None, "torch not installed: flashattn only"
    print(f"flashattn {fa.__version__}, {fa.get_num_threads()} threads, cpu isa {fa.cpu_isa()}, "
          f"{note}; load average at start {os.getloadavg()[0]:.2f}")
    if args.only in (None, "options"):
        options_section(args.repeat, torch)
    if args.only in (None, "varlen"):
        varlen_section(args.repeat)
    if args.only in (None, "varlen", "one-launch"):
        one_launch_section(args.repeat)
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
