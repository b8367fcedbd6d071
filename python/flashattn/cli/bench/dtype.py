"""`python -m flashattn bench --dtype bf16|fp16`: the cpu engine in float16
or bfloat16 against PyTorch's ``scaled_dot_product_attention`` on the CPU in
the same dtype, and against its own float32, in one process, interleaved.

The shapes are those of the float32 table. For each, six calls run once to
warm up and then ``--repeat`` times (at least 5) in alternating order: ours
in the dtype, forward and forward + backward, the same in float32, and
torch in the dtype. The table shows minimum (and median) times, GFLOP/s
(forward 4*B*H*Tq*Tk*D, halved for causal; forward + backward 3.5x that),
the speedup over torch (torch's minimum over ours) and over our own
float32. ``--json FILE`` writes every figure and each run's time;
``--dtype fp32`` runs the ordinary float32 bench.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from ..args import positive_int
from .output import Column, Progress, Report, Table, geomean, ms_runs, threads


def run(args, torch, progress):
    from .cpu import SHAPES, Problem, forward_flops, interleaved, shape_label

    rows = []
    for shape in SHAPES:
        label = shape_label(*shape)
        progress.step(f"{args.dtype} B,T,H/Hkv,D = {label}")
        half = Problem(*shape, torch=torch, dtype=args.dtype)
        single = Problem(*shape, dtype="fp32")
        fns = {"ours fwd": half.ours_forward, "ours fwd+bwd": half.ours_forward_backward,
               "fp32 fwd": single.ours_forward, "fp32 fwd+bwd": single.ours_forward_backward}
        if torch is not None:
            fns["torch fwd"] = half.torch_forward
            fns["torch fwd+bwd"] = half.torch_forward_backward
        times = interleaved(fns, args.repeat, progress, label)
        B, T, H, Hkv, D, causal = shape
        rows.append((shape, forward_flops(B, T, T, H, D, causal), times))
    return rows


def dtype_table(rows, dtype, have_torch):
    from .cpu import shape_label

    cols = [Column("shape", "B, T, H/Hkv, D, mask"), Column("pass", "pass"),
            Column("ours_ms", f"ours {dtype} ms", ".2f"), Column("ours_median_ms", "median", ".2f"),
            Column("ours_gflops", "GFLOP/s", ".1f"), Column("fp32_ms", "ours fp32 ms", ".2f"),
            Column("vs_fp32", "x fp32", "x")]
    if have_torch:
        cols += [Column("torch_ms", f"torch {dtype} ms", ".2f"),
                 Column("torch_median_ms", "median", ".2f"),
                 Column("torch_gflops", "GFLOP/s", ".1f"), Column("speedup", "x torch", "x")]
    table = Table("dtype", f"{dtype}, cpu engine: min of the interleaved runs and their median; "
                  f"GFLOP/s from the min; x torch = torch {dtype} min / ours; x fp32 = our "
                  f"float32 min / ours {dtype}", cols)
    ratios = {"fwd": [], "fwd+bwd": []}
    own = {"fwd": [], "fwd+bwd": []}
    for shape, fl, times in rows:
        for kind, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            ours, single = times[f"ours {kind}"], times[f"fp32 {kind}"]
            own[kind].append(min(single) / min(ours))
            row = {"shape": shape_label(*shape), "pass": kind, "ours_ms": min(ours) * 1e3,
                   "ours_median_ms": statistics.median(ours) * 1e3,
                   "ours_gflops": mult * fl / min(ours) / 1e9, "fp32_ms": min(single) * 1e3,
                   "vs_fp32": own[kind][-1], "ours_runs_ms": ms_runs(ours),
                   "fp32_runs_ms": ms_runs(single)}
            if have_torch:
                th = times[f"torch {kind}"]
                ratios[kind].append(min(th) / min(ours))
                row.update(torch_ms=min(th) * 1e3, torch_median_ms=statistics.median(th) * 1e3,
                           torch_gflops=mult * fl / min(th) / 1e9, speedup=ratios[kind][-1],
                           torch_runs_ms=ms_runs(th))
            table.add(row)
    for kind in ("fwd", "fwd+bwd"):
        mean = geomean(own[kind])
        table.note(f"ours {dtype} against ours fp32, {kind:<8}: geometric mean {mean:.2f}x",
                   **{"pass": kind}, vs_fp32_geomean=mean)
    if have_torch:
        for kind in ("fwd", "fwd+bwd"):
            r = ratios[kind]
            table.note(f"speedup over torch {dtype}, {kind:<8}: geometric mean {geomean(r):.2f}x, "
                       f"lowest {min(r):.2f}x", **{"pass": kind}, geomean=geomean(r),
                       lowest=min(r))
    return table


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashattn bench --dtype",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), required=True,
                        help="the inputs' dtype, for both engines")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="threads for both engines (default: flashattn's default)")
    parser.add_argument("--repeat", type=positive_int, default=5,
                        help="timed runs per case (>= 5)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure, each run's "
                        "time and the machine's description to FILE (JSON)")
    args, rest = parser.parse_known_args(argv)
    if args.dtype == "fp32":
        from . import cpu

        return cpu.main(rest + ([f"--threads={args.threads}"] if args.threads else []) +
                        ([f"--json={args.json}"] if args.json else []) + [f"--repeat={args.repeat}"])
    if rest:
        parser.error(f"unrecognised arguments with --dtype {args.dtype}: {' '.join(rest)}")
    if args.repeat < 5:
        parser.error("--repeat must be at least 5")

    import flashattn as fa
    from .cpu import SHAPES, import_torch

    if args.threads is not None:
        fa.set_num_threads(args.threads)
    args.threads = fa.get_num_threads()
    torch, torch_note = import_torch(args.threads)
    progress = Progress(len(SHAPES))
    rows = run(args, torch, progress)
    progress.close()
    report = Report(f"bench --dtype {args.dtype}: the cpu engine in {args.dtype} against torch "
                    "SDPA and against its own float32",
                    {"dtype": args.dtype, "threads": args.threads, "repeat": args.repeat})
    report.line(f"competitor: {torch_note}", competitor=torch_note)
    report.line(f"{args.dtype}, {threads(args.threads)}, {args.repeat} timed runs per case after "
                "a warm-up, calls interleaved")
    report.add(dtype_table(rows, args.dtype, torch is not None))
    report.print()
    report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
