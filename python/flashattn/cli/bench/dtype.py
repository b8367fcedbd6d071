"""`python -m flashattn bench --dtype bf16|fp16`: the cpu engine in float16
or bfloat16 against PyTorch's ``scaled_dot_product_attention`` on the CPU in
the same dtype, and against its own float32, in one process, interleaved.

The shapes are the float32 table's (cpu.SHAPES). For each, six calls run
once to warm up and then ``--repeat`` times (at least 5) in alternating
order: ours in the dtype, forward and forward + backward, the same in
float32, and torch in the dtype. The table shows minimum (and median) times,
GFLOP/s (forward 4*B*H*Tq*Tk*D, halved for causal; forward + backward 3.5x
that), the speedup over torch (torch's minimum over ours) and over our own
float32. Goal (issue 15): a geometric mean >= 1.5x torch, no shape below 1.2x.
``--dtype fp32`` runs the ordinary float32 bench.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from ..args import positive_int

GOAL_MEAN, GOAL_EACH = 1.5, 1.2


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


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def print_table(rows, dtype, have_torch):
    from .cpu import shape_label

    print(f"\nmin of the interleaved runs (median in brackets); GFLOP/s from the min; "
          f"x torch = torch {dtype} min / ours; x fp32 = our float32 min / ours {dtype}")
    head = (f"{'B, T, H/Hkv, D, mask':<28} {'pass':<8} {f'ours {dtype} ms':>20} {'GFLOP/s':>8} "
            f"{'ours fp32 ms':>12} {'x fp32':>7}")
    if have_torch:
        head += f" {f'torch {dtype} ms':>20} {'GFLOP/s':>8} {'x torch':>8}"
    print(head)
    print("-" * len(head))
    ratios = {"fwd": [], "fwd+bwd": []}
    own = {"fwd": [], "fwd+bwd": []}
    for shape, fl, times in rows:
        for kind, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            ours, single = times[f"ours {kind}"], times[f"fp32 {kind}"]
            own[kind].append(min(single) / min(ours))
            line = (f"{shape_label(*shape):<28} {kind:<8} "
                    f"{min(ours) * 1e3:9.2f} ({statistics.median(ours) * 1e3:8.2f})"
                    f" {mult * fl / min(ours) / 1e9:8.1f} {min(single) * 1e3:12.2f}"
                    f" {own[kind][-1]:6.2f}x")
            if have_torch:
                th = times[f"torch {kind}"]
                ratios[kind].append(min(th) / min(ours))
                line += (f" {min(th) * 1e3:9.2f} ({statistics.median(th) * 1e3:8.2f})"
                         f" {mult * fl / min(th) / 1e9:8.1f} {ratios[kind][-1]:7.2f}x")
            print(line)
    print()
    for kind in ("fwd", "fwd+bwd"):
        print(f"ours {dtype} against ours fp32, {kind:<8}: geometric mean {geomean(own[kind]):.2f}x")
    if have_torch:
        for kind in ("fwd", "fwd+bwd"):
            r = ratios[kind]
            geo = geomean(r)
            verdict = "met" if geo >= GOAL_MEAN and min(r) >= GOAL_EACH else "NOT met"
            print(f"speedup over torch {dtype}, {kind:<8}: geometric mean {geo:.2f}x, lowest "
                  f"{min(r):.2f}x  (goal: >= {GOAL_MEAN}x mean, >= {GOAL_EACH}x each: {verdict})")


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
    args, rest = parser.parse_known_args(argv)
    if args.dtype == "fp32":
        from . import cpu

        return cpu.main(rest + ([f"--threads={args.threads}"] if args.threads else []) +
                           [f"--repeat={args.repeat}"])
    if rest:
        parser.error(f"unrecognised arguments with --dtype {args.dtype}: {' '.join(rest)}")
    if args.repeat < 5:
        parser.error("--repeat must be at least 5")

    import flashattn as fa
    from .cpu import SHAPES, Progress, import_torch

    if args.threads is not None:
        fa.set_num_threads(args.threads)
    args.threads = fa.get_num_threads()
    torch, torch_note = import_torch(args.threads)
    progress = Progress(len(SHAPES))
    rows = run(args, torch, progress)
    progress.close()
    print(f"flashattn {fa.__version__} cpu engine vs {torch_note}")
    print(f"{args.dtype}, {args.threads} threads, {args.repeat} timed runs per case after a "
          f"warm-up, calls interleaved; cpu instruction set {fa.cpu_isa()}")
    print_table(rows, args.dtype, torch is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
