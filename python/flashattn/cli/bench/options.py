"""`python -m flashattn bench options`: what the score options and
variable-length batches cost on the cpu engine, with torch SDPA's
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
``--json FILE`` writes every figure and each run's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from ..args import positive_int
from .output import Column, Progress, Report, Table, ms_runs, threads

OPTIONS_SHAPE = (1, 2048, 8, 8, 64)  # B, T, H, Hkv, D; causal
VARLEN_LENGTHS = [1536, 768, 384, 256, 128, 128, 64, 64, 32, 16]
VARLEN_HEADS = (8, 8, 64)  # H, Hkv, D
SHORT_BATCH = (256, 64)  # sequences, tokens each: issue 34's first varlen case
MIXED_BATCH = (64, 512)  # sequences, longest: lengths drawn from 1..512 (seeded)


def _interleaved(fns, repeat, progress):
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    names = list(fns)
    for r in range(repeat):
        progress.note(f"run {r + 1}/{repeat}")
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def options_section(repeat, torch, progress):
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
    progress.step(f"score options, B={B}, T={T}, H={H}, D={D}")
    times = _interleaved(fns, repeat, progress)

    cols = [Column("option", "option"), Column("pass", "pass"),
            Column("ours_ms", "flashattn ms", ".2f"), Column("ours_median_ms", "median", ".2f"),
            Column("cost", "cost", "+.1%")]
    if torch is not None:
        cols += [Column("torch_ms", "torch SDPA ms", ".2f"),
                 Column("torch_median_ms", "median", ".2f"), Column("speedup", "torch / ours", "x")]
    table = Table("options", f"score options, cpu engine: B={B}, T={T}, H={H}, D={D}, causal; "
                  f"min and median ms of {repeat} interleaved runs; cost = min / plain's min - 1",
                  cols)
    for kind in ("fwd", "fwd+bwd"):
        plain = min(times[("ours", kind, "plain")])
        for name in variants:
            ours = times[("ours", kind, name)]
            row = {"option": name, "pass": kind, "ours_ms": min(ours) * 1e3,
                   "ours_median_ms": statistics.median(ours) * 1e3, "cost": min(ours) / plain - 1,
                   "ours_runs_ms": ms_runs(ours)}
            key = ("torch", kind, name)
            if key in times:
                th = times[key]
                row.update(torch_ms=min(th) * 1e3, torch_median_ms=statistics.median(th) * 1e3,
                           speedup=min(th) / min(ours), torch_runs_ms=ms_runs(th))
            table.add(row)
    if torch is not None:
        table.note("torch: plain is is_causal=True; alibi is an additive (1, H, T, T) causal "
                   "bias; the bool and float masks the same (T, T) arrays")
    return table


def varlen_section(repeat, progress):
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
    progress.step(f"varlen, H={H}, D={D}")
    times = _interleaved(fns, repeat, progress)
    work = {"skewed": sum(t * t for t in skewed), "equal": sum(t * t for t in equal),
            "padded": len(skewed) * T_max * T_max}
    table = Table("varlen", f"varlen, cpu engine, causal forward: H={H}, D={D}; skewed lengths "
                  f"{skewed}; 'equal' has {len(equal)} sequences of {equal[0]} (the same sum "
                  f"T^2); 'padded' is the skewed batch padded to {T_max}",
                  [Column("batch", "batch"), Column("work", "sum T_b^2", "d"),
                   Column("ms", "ms", ".2f"), Column("median_ms", "median", ".2f"),
                   Column("ns_per_t2", "ns per T^2", ".3f"),
                   Column("vs_skewed", "time / skewed", "x")])
    base = min(times["skewed"])
    for name in ("skewed", "equal", "padded"):
        ts = times[name]
        table.add({"batch": name, "work": work[name], "ms": min(ts) * 1e3,
                   "median_ms": statistics.median(ts) * 1e3,
                   "ns_per_t2": min(ts) / work[name] * 1e9, "vs_skewed": min(ts) / base,
                   "runs_ms": ms_runs(ts)})
    ratio = work["padded"] / work["skewed"]
    table.note(f"padded / skewed work ratio: {ratio:.2f}", padded_work_ratio=ratio)
    return table


def _causal_work(lengths):
    """(query, key) pairs a causal call computes: sum of T (T + 1) / 2."""
    return sum(t * (t + 1) // 2 for t in lengths)


def one_launch_section(repeat, progress, backend="cpu"):
    """A varlen call, in one engine call and in one per sequence, against a
    dense batch of the same work, on `backend` (cpu here; bench --backend
    metal runs it on the metal engine: one plan per varlen call there)."""
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
                                          0.0, None, None, lse, backend, per_sequence)

        def varlen_bwd(o, lse, q=q, k=k, v=v, cu=cu, do=do, per_sequence=False):
            _api._attention_varlen_backward(do, q, k, v, o, lse, cu, cu, None, None, True,
                                            (-1, -1), None, 0.0, None, None, backend,
                                            per_sequence)

        def loop(lse, varlen=varlen):
            return varlen(lse, per_sequence=True)

        def loop_bwd(o, lse, varlen_bwd=varlen_bwd):
            varlen_bwd(o, lse, per_sequence=True)

        def dense(lse, q=dq, k=dk, v=dv):
            return fa.attention(q, k, v, causal=True, return_lse=lse, backend=backend)

        def dense_bwd(o, lse, q=dq, k=dk, v=dv, do=ddo):
            fa.attention_backward(do, q, k, v, o, lse, causal=True, backend=backend)

        for kind, f in zip(("fwd", "fwd+bwd"), passes(varlen, varlen_bwd)):
            fns[(name, kind, "varlen")] = f
        for kind, f in zip(("fwd", "fwd+bwd"), passes(loop, loop_bwd)):
            fns[(name, kind, "per sequence")] = f
        for kind, f in zip(("fwd", "fwd+bwd"), passes(dense, dense_bwd)):
            fns[(name, kind, "dense")] = f
        work[(name, "varlen")] = _causal_work(lengths)
        work[(name, "dense")] = B * _causal_work([T])
    progress.step(f"varlen in one call, H={H}, D={D}")
    times = _interleaved(fns, repeat, progress)

    table = Table("one-launch", "varlen in one call against a dense batch of the same work, "
                  f"{backend} engine, causal: H={H}, Hkv={Hkv}, D={D}; mixed: {n_mixed} lengths drawn from "
                  f"1..{longest} (seed 2), dense {n_mixed} x {rms} (the same sum T (T + 1) / 2 to "
                  "within rounding); / dense: time per unit of work (sum T (T + 1) / 2) over "
                  "dense's",
                  [Column("batch", "batch"), Column("pass", "pass"), Column("dense", "dense"),
                   Column("dense_ms", "ms", ".2f"), Column("dense_median_ms", "median", ".2f"),
                   Column("varlen_ms", "one call ms", ".2f"),
                   Column("varlen_median_ms", "median", ".2f"),
                   Column("varlen_vs_dense", "/ dense", "x"),
                   Column("per_sequence_ms", "per sequence ms", ".2f"),
                   Column("per_sequence_median_ms", "median", ".2f"),
                   Column("per_sequence_vs_dense", "/ dense", "x")])
    for name, (lengths, (B, T)) in cases.items():
        for kind in ("fwd", "fwd+bwd"):
            td = times[(name, kind, "dense")]
            row = {"batch": name, "pass": kind, "dense": f"{B}x{T}", "dense_ms": min(td) * 1e3,
                   "dense_median_ms": statistics.median(td) * 1e3, "dense_runs_ms": ms_runs(td)}
            for variant in ("varlen", "per sequence"):
                tv = times[(name, kind, variant)]
                key = variant.replace(" ", "_")
                row[f"{key}_ms"] = min(tv) * 1e3
                row[f"{key}_median_ms"] = statistics.median(tv) * 1e3
                row[f"{key}_vs_dense"] = ((min(tv) / work[(name, "varlen")]) /
                                          (min(td) / work[(name, "dense")]))
                row[f"{key}_runs_ms"] = ms_runs(tv)
            table.add(row)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashattn bench options",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=positive_int, default=5, help="timed runs (>= 5)")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--only", choices=("options", "varlen", "one-launch"), default=None,
                        help="one section (varlen also runs one-launch)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure, each run's "
                        "time and the machine's description to FILE (JSON)")
    args = parser.parse_args(argv)
    if args.repeat < 5:
        parser.error("--repeat must be at least 5")
    import flashattn as fa

    if args.threads:
        fa.set_num_threads(args.threads)
    try:
        import torch

        torch.set_num_threads(fa.get_num_threads())
        note = f"torch {torch.__version__} scaled_dot_product_attention"
    except ImportError:
        torch, note = None, "torch not installed: flashattn only"
    sections = {None: ["options", "varlen", "one-launch"], "options": ["options"],
                "varlen": ["varlen", "one-launch"], "one-launch": ["one-launch"]}[args.only]
    report = Report("bench options: the score options and varlen on the cpu engine",
                    {"dtype": "float32", "threads": fa.get_num_threads(), "repeat": args.repeat,
                     "sections": sections})
    report.line(f"competitor: {note}; {threads(fa.get_num_threads())}", competitor=note)
    progress = Progress(len(sections))
    if "options" in sections:
        report.add(options_section(args.repeat, torch, progress))
    if "varlen" in sections:
        report.add(varlen_section(args.repeat, progress))
    if "one-launch" in sections:
        report.add(one_launch_section(args.repeat, progress))
    progress.close()
    report.print()
    report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
