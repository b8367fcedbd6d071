"""`python -m flashattn bench`: the cpu engine against PyTorch's
``scaled_dot_product_attention`` on the CPU, float32, in one process, the
same thread count for both.

Each engine runs every case once to warm up, then ``--repeat`` times (at
least 5), the contenders interleaved in alternating order; tables show the
minimum (and median) time, GFLOP/s, the share of an FMA peak measured in the
same run, and speedups (torch's minimum over ours). FLOPs: forward
4*B*H*Tq*Tk*D, halved for causal; backward 2.5x forward. The header names
the machine: CPU model, cores, instruction-set extensions.

Sections, in order (``--only`` and ``--skip`` take their names):
  table    six training shapes, forward and forward + backward
  window   sliding window (255, 0) against full causal at T = 16384
  memory   peak memory of a T = 65536 forward + backward (a child process)
  decode   one to four queries against a long KV cache, against the
           read bandwidth measured in the run
  long-t   T = 4096 to 65536
  gqa-bwd  the GQA backward against MHA at the same FLOPs
  small    T <= 512, against the FMA peak; the thread pool's wake-up cost

torch is optional (``pip install 'flashattn[bench]'``); without it only our
own figures are shown. ``--plot FILE.png`` draws throughput against T
(matplotlib); ``--json FILE`` writes every figure and each run's time.
Other benchmarks: ``bench --dtype bf16|fp16`` (half precision against
torch in the same dtype), ``bench options`` (score options and varlen),
``bench --backend metal`` (the metal engine against MLX, on a Mac).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from . import limits as _limits
from ..args import positive_int
from .output import Column, Progress, Report, Table, geomean, ms_runs, threads

# (B, T, H, Hkv, D, causal): the shapes of the speed targets.
SHAPES = [
    (1, 1024, 8, 8, 64, True),
    (1, 1024, 8, 8, 64, False),
    (1, 4096, 8, 8, 64, True),
    (4, 512, 8, 8, 64, True),
    (1, 2048, 32, 8, 128, True),
    (8, 256, 4, 4, 32, False),
]
PLOT_TS = [256, 512, 1024, 2048, 4096]
WINDOW_T, WINDOW = 16384, (255, 0)
MEMORY_T = 65536
# Every section, in the order they run (the last four: limits.py).
SECTIONS = ("table", "window", "memory", "decode", "long-t", "gqa-bwd", "small")


def forward_flops(B, Tq, Tk, H, D, causal):
    return 4.0 * B * H * Tq * Tk * D * (0.5 if causal else 1.0)


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Problem:
    """Inputs of one shape for both engines, and the four timed calls."""

    def __init__(self, B, T, H, Hkv, D, causal, window=(-1, -1), torch=None, dtype="fp32"):
        """dtype: 'fp32', 'fp16' or 'bf16', for both engines (the same values:
        float32 normals rounded to the dtype, to nearest even, by each)."""
        import ml_dtypes

        import flashattn as fa

        self.fa = fa
        self.causal, self.window = causal, window
        rng = np.random.default_rng(0)
        ours = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype]
        f32 = [rng.standard_normal(shape, dtype=np.float32)
               for shape in ((B, T, H, D), (B, T, Hkv, D), (B, T, Hkv, D), (B, T, H, D))]
        self.q, self.k, self.v, self.do = (x.astype(ours) for x in f32)
        self.torch = torch
        if torch is not None:
            theirs = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]

            def t(x):
                return torch.from_numpy(x).permute(0, 2, 1, 3).contiguous().to(theirs)

            self.tq, self.tk, self.tv, self.tdo = (t(x) for x in f32)
            self.tqg = self.tq.clone().requires_grad_()
            self.tkg = self.tk.clone().requires_grad_()
            self.tvg = self.tv.clone().requires_grad_()
            self.gqa = H != Hkv

    def ours_forward(self):
        self.fa.attention(self.q, self.k, self.v, causal=self.causal, window=self.window,
                          backend="cpu")

    def ours_forward_backward(self):
        fa = self.fa
        o, lse = fa.attention(self.q, self.k, self.v, causal=self.causal, window=self.window,
                              return_lse=True, backend="cpu")
        fa.attention_backward(self.do, self.q, self.k, self.v, o, lse, causal=self.causal,
                              window=self.window, backend="cpu")

    def forward_outputs(self):
        """o and lse of our forward, for timing the backward alone."""
        return self.fa.attention(self.q, self.k, self.v, causal=self.causal, window=self.window,
                                 return_lse=True, backend="cpu")

    def ours_backward(self, o, lse):
        self.fa.attention_backward(self.do, self.q, self.k, self.v, o, lse, causal=self.causal,
                                   window=self.window, backend="cpu")

    def torch_forward(self):
        torch = self.torch
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(
                self.tq, self.tk, self.tv, is_causal=self.causal, enable_gqa=self.gqa)

    def torch_forward_backward(self):
        torch = self.torch
        o = torch.nn.functional.scaled_dot_product_attention(
            self.tqg, self.tkg, self.tvg, is_causal=self.causal, enable_gqa=self.gqa)
        torch.autograd.grad(o, (self.tqg, self.tkg, self.tvg), self.tdo)


def interleaved(fns, repeat, progress, label):
    """Times each fn `repeat` times after one warm-up each, alternating the
    order every round so that no engine always runs first."""
    times = {name: [] for name in fns}
    for name, fn in fns.items():
        progress.note(f"{label}: warm-up {name}")
        fn()
    names = list(fns)
    for r in range(repeat):
        progress.note(f"{label}: run {r + 1}/{repeat}")
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(_seconds(fns[name]))
    return times


def import_torch(threads):
    """(torch with `threads` threads, or None; a line naming the competitor).

    torch's OpenMP threads are told to sleep when idle (OMP_WAIT_POLICY=PASSIVE,
    unless the environment says otherwise): by default they spin after every
    call, on the cores the next contender is then timed on. On 2026-12-05's
    2-core Zen 3 our bfloat16 forward (B=1, T=1024, H=8, D=64) took 18.5 ms
    right after torch's and 14.5 ms after our own; with PASSIVE 14.8 ms after
    torch's, while torch's own forward and forward + backward times did not
    move (16.2-16.3 ms and 246-263 ms either way)."""
    imported = "torch" in sys.modules
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch
    except ImportError:
        return None, "torch not installed (pip install 'flashattn[bench]'): cpu engine only"
    torch.set_num_threads(threads)
    policy = ("as torch was started with" if imported
              else f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    return torch, f"torch {torch.__version__} scaled_dot_product_attention ({policy})"


def fma_peak(threads):
    from ... import _core

    return max(_core._cpu_fma_peak(0.3, threads) for _ in range(2))


def shape_label(B, T, H, Hkv, D, causal):
    return f"{B}, {T}, {H}/{Hkv}, {D}, {'causal' if causal else 'full'}"


def run_table(args, torch, progress, peaks):
    rows = []
    for shape in SHAPES:
        B, T, H, Hkv, D, causal = shape
        label = shape_label(*shape)
        progress.step(f"B,T,H/Hkv,D = {label}")
        prob = Problem(*shape, torch=torch)
        fns = {"ours fwd": prob.ours_forward, "ours fwd+bwd": prob.ours_forward_backward}
        if torch is not None:
            fns["torch fwd"] = prob.torch_forward
            fns["torch fwd+bwd"] = prob.torch_forward_backward
        times = interleaved(fns, args.repeat, progress, label)
        fl = forward_flops(B, T, T, H, D, causal)
        rows.append((shape, fl, times))
        peaks.append(fma_peak(args.threads))
    return rows


def speed_table(rows, peak, have_torch, dtype="float32"):
    cols = [Column("shape", "B, T, H/Hkv, D, mask"), Column("pass", "pass"),
            Column("ours_ms", "flashattn ms", ".2f"), Column("ours_median_ms", "median", ".2f"),
            Column("ours_gflops", "GFLOP/s", ".1f"), Column("ours_peak", "% peak", "%")]
    if have_torch:
        cols += [Column("torch_ms", "torch ms", ".2f"), Column("torch_median_ms", "median", ".2f"),
                 Column("torch_gflops", "GFLOP/s", ".1f"), Column("torch_peak", "% peak", "%"),
                 Column("speedup", "speedup", "x")]
    table = Table("table", f"{dtype}, cpu engine against torch SDPA: min of the interleaved runs "
                  "and their median; GFLOP/s and % of the FMA peak from the min; speedup = "
                  "torch's min / ours", cols)
    ratios = {"fwd": [], "fwd+bwd": []}
    for shape, fl, times in rows:
        for kind, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            ours = times[f"ours {kind}"]
            rate = mult * fl / min(ours) / 1e9
            row = {"shape": shape_label(*shape), "pass": kind, "ours_ms": min(ours) * 1e3,
                   "ours_median_ms": statistics.median(ours) * 1e3, "ours_gflops": rate,
                   "ours_peak": rate / peak, "ours_runs_ms": ms_runs(ours)}
            if have_torch:
                th = times[f"torch {kind}"]
                trate = mult * fl / min(th) / 1e9
                ratios[kind].append(min(th) / min(ours))
                row.update(torch_ms=min(th) * 1e3, torch_median_ms=statistics.median(th) * 1e3,
                           torch_gflops=trate, torch_peak=trate / peak, speedup=ratios[kind][-1],
                           torch_runs_ms=ms_runs(th))
            table.add(row)
    if have_torch:
        for kind in ("fwd", "fwd+bwd"):
            r = ratios[kind]
            table.note(f"speedup over torch, {kind:<8}: geometric mean {geomean(r):.2f}x, "
                       f"lowest {min(r):.2f}x", **{"pass": kind}, geomean=geomean(r),
                       lowest=min(r))
    return table


def run_window(args, progress):
    B, H, D = 1, 8, 64
    progress.step(f"sliding window at T={WINDOW_T}")
    full = Problem(B, WINDOW_T, H, H, D, True)
    win = Problem(B, WINDOW_T, H, H, D, True, window=WINDOW)
    fns = {"full fwd": full.ours_forward, "window fwd": win.ours_forward,
           "full fwd+bwd": full.ours_forward_backward,
           "window fwd+bwd": win.ours_forward_backward}
    times = interleaved(fns, args.repeat, progress, f"window T={WINDOW_T}")
    return times


def window_table(times):
    table = Table("window", f"sliding window, cpu engine: B=1, T={WINDOW_T}, H=8, D=64, causal, "
                  f"window={WINDOW} against full causal (min of the runs)",
                  [Column("pass", "pass"), Column("full_ms", "full ms", ".1f"),
                   Column("window_ms", "window ms", ".1f"),
                   Column("speedup", "window speedup", "x")])
    for kind in ("fwd", "fwd+bwd"):
        full, win = times[f"full {kind}"], times[f"window {kind}"]
        table.add({"pass": kind, "full_ms": min(full) * 1e3, "window_ms": min(win) * 1e3,
                   "speedup": min(full) / min(win), "full_runs_ms": ms_runs(full),
                   "window_runs_ms": ms_runs(win)})
    return table


def memory_child(T, threads):
    """Runs in a fresh process: peak RSS of one causal forward + backward
    beyond its inputs and outputs, reported as JSON on stdout."""
    import resource

    import flashattn as fa

    fa.set_num_threads(threads)
    B, H, D = 1, 8, 64
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((B, T, H, D), dtype=np.float32) for _ in range(4))

    # ru_maxrss is in bytes on macOS, KiB on Linux.
    maxrss_unit = 1 if sys.platform == "darwin" else 1024

    def maxrss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * maxrss_unit

    def rss_now():
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # no /proc (macOS): the peak so far, reached by the inputs just made
            return maxrss()

    def hwm():
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    base = rss_now()
    reset = False
    try:  # restart the high-water mark here, so that only the calls count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        pass
    before_max = maxrss()
    t0 = time.perf_counter()
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    t1 = time.perf_counter()
    dq, dk, dv = fa.attention_backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    t2 = time.perf_counter()
    if reset and hwm() is not None:
        peak = hwm()
    else:  # the lifetime peak: only valid when nothing before the calls was larger
        peak = max(maxrss(), before_max)
    outputs = sum(x.nbytes for x in (o, lse, dq, dk, dv))
    inputs = sum(x.nbytes for x in (q, k, v, do))
    print(json.dumps({"base": base, "peak": peak, "inputs": inputs, "outputs": outputs,
                      "forward_s": t1 - t0, "backward_s": t2 - t1, "reset": reset}))


def run_memory(args, progress, fwd_rate):
    fl = forward_flops(1, MEMORY_T, MEMORY_T, 8, 64, True)
    eta = 3.5 * fl / fwd_rate if fwd_rate else float("nan")
    progress.step(f"memory at T={MEMORY_T} in a child process (about {eta:.0f} s)")
    cmd = [sys.executable, "-c",
           "import sys, flashattn.cli.bench.cpu as b; b.memory_child(int(sys.argv[1]), int(sys.argv[2]))",
           str(MEMORY_T), str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def memory_table(m):
    MiB = 1024.0 * 1024.0
    fl = forward_flops(1, MEMORY_T, MEMORY_T, 8, 64, True)
    table = Table("memory", f"memory, cpu engine: B=1, T={MEMORY_T}, H=8, D=64, causal forward + "
                  "backward in a child process; peak RSS beyond its inputs and outputs" +
                  ("" if m["reset"] else " (from ru_maxrss: VmHWM could not be reset)"),
                  [Column("inputs_mib", "inputs MiB", ".0f"),
                   Column("outputs_mib", "outputs MiB", ".0f"),
                   Column("extra_mib", "peak beyond them MiB", ".1f"),
                   Column("scores_gib", "T x T scores GiB", ".0f"),
                   Column("forward_s", "fwd s", ".1f"), Column("forward_gflops", "GFLOP/s", ".1f"),
                   Column("backward_s", "bwd s", ".1f"),
                   Column("backward_gflops", "GFLOP/s", ".1f")])
    table.add({"inputs_mib": m["inputs"] / MiB, "outputs_mib": m["outputs"] / MiB,
               "extra_mib": (m["peak"] - m["base"] - m["outputs"]) / MiB,
               "scores_gib": 8 * MEMORY_T * MEMORY_T * 4 / 1024 ** 3,
               "forward_s": m["forward_s"], "forward_gflops": fl / m["forward_s"] / 1e9,
               "backward_s": m["backward_s"], "backward_gflops": 2.5 * fl / m["backward_s"] / 1e9})
    return table


def run_plot(args, torch, progress, path):
    results = {"ours fwd": [], "ours fwd+bwd": [], "torch fwd": [], "torch fwd+bwd": []}
    for T in PLOT_TS:
        progress.step(f"plot: T={T}")
        prob = Problem(1, T, 8, 8, 64, True, torch=torch)
        fns = {"ours fwd": prob.ours_forward, "ours fwd+bwd": prob.ours_forward_backward}
        if torch is not None:
            fns["torch fwd"] = prob.torch_forward
            fns["torch fwd+bwd"] = prob.torch_forward_backward
        times = interleaved(fns, args.repeat, progress, f"plot T={T}")
        fl = forward_flops(1, T, T, 8, 64, True)
        for name, ts in times.items():
            results[name].append((3.5 if "bwd" in name else 1.0) * fl / min(ts) / 1e9)
    draw_plot(results, args.threads, path)
    return results


def plot_table(results, path):
    table = Table("plot", f"throughput against T (B=1, H=8, D=64, causal), GFLOP/s from the min; "
                  f"plotted in {path}",
                  [Column("T", "T", "d")] + [Column(name.replace(" ", "_"), f"{name} GFLOP/s", ".1f")
                                             for name, rates in results.items() if rates])
    for i, T in enumerate(PLOT_TS):
        table.add(dict({"T": T}, **{name.replace(" ", "_"): rates[i]
                                    for name, rates in results.items() if rates}))
    return table


def draw_plot(results, threads, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, kind in zip(axes, ("fwd", "fwd+bwd")):
        ax.plot(PLOT_TS, results[f"ours {kind}"], "o-", label="flashattn cpu")
        if results[f"torch {kind}"]:
            ax.plot(PLOT_TS, results[f"torch {kind}"], "s--", label="torch SDPA")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (B=1, H=8, D=64, causal)")
        ax.set_title(kind)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("GFLOP/s")
    fig.suptitle(f"float32, {threads} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m flashattn bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="threads for both engines (default: flashattn's default)")
    parser.add_argument("--repeat", type=positive_int, default=5,
                        help="timed runs per case (>= 5)")
    parser.add_argument("--plot", metavar="FILE.png", help="save throughput against T")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: "
                        + ", ".join(SECTIONS))
    parser.add_argument("--only", default="", help="comma list of the sections to run "
                        "(default: all)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure, each run's "
                        "time and the machine's description to FILE (JSON)")
    parser.add_argument("--long-t-torch", type=positive_int, default=16384, metavar="T",
                        help="longest T of the long-T section that torch also runs "
                        "(default 16384: at 65536 torch alone takes minutes)")
    args = parser.parse_args(argv)
    if args.repeat < 5:
        parser.error("--repeat must be at least 5")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for flag, names in (("--skip", skip), ("--only", only)):
        unknown = names - set(SECTIONS)
        if unknown:
            parser.error(f"{flag}: unknown section(s) {sorted(unknown)}; "
                         f"sections: {', '.join(SECTIONS)}")
    if only:
        skip |= set(SECTIONS) - only

    import flashattn as fa

    if args.threads is not None:
        fa.set_num_threads(args.threads)
    args.threads = fa.get_num_threads()
    torch, torch_note = import_torch(args.threads)

    sections = (0 if "table" in skip else len(SHAPES)) + (0 if "window" in skip else 1) + \
        (0 if "memory" in skip else 1) + (len(PLOT_TS) if args.plot else 0) + \
        sum(len(cases) for name, cases in _limits.CASES.items() if name not in skip)
    progress = Progress(sections)
    peaks = [fma_peak(args.threads)]
    rows = run_table(args, torch, progress, peaks) if "table" not in skip else []
    window = run_window(args, progress) if "window" not in skip else None
    # The child's expected time, from the largest shape's forward rate.
    rate = max((fl / min(times["ours fwd"]) for shape, fl, times in rows), default=None)
    memory = run_memory(args, progress, rate or 100e9) if "memory" not in skip else None
    plot = run_plot(args, torch, progress, args.plot) if args.plot else None
    decode = _limits.run_decode(args, torch, progress, interleaved) if "decode" not in skip else None
    long_t = (_limits.run_long_t(args, torch, progress, interleaved, Problem)
              if "long-t" not in skip else None)
    gqa = (_limits.run_gqa_backward(args, torch, progress, interleaved, Problem)
           if "gqa-bwd" not in skip else None)
    small = (_limits.run_small(args, torch, progress, interleaved, Problem)
             if "small" not in skip else None)
    peaks.append(fma_peak(args.threads))
    progress.close()

    peak = max(peaks)
    report = Report("bench: the cpu engine against torch SDPA",
                    {"dtype": "float32", "threads": args.threads, "repeat": args.repeat,
                     "sections": [name for name in SECTIONS if name not in skip]})
    report.line(f"competitor: {torch_note}", competitor=torch_note)
    report.line(f"float32, {threads(args.threads)}, {args.repeat} timed runs per case after a "
                "warm-up, engines interleaved")
    report.line(f"FMA peak measured in this run: {peak:.1f} GFLOP/s (best of {len(peaks)} "
                f"measurements, lowest {min(peaks):.1f})", fma_peak_gflops=peak,
                fma_peak_measurements_gflops=peaks)
    if rows:
        report.add(speed_table(rows, peak, torch is not None))
    if window:
        report.add(window_table(window))
    if memory:
        report.add(memory_table(memory))
    if plot:
        report.add(plot_table(plot, args.plot))
    if decode:
        report.add(_limits.decode_table(decode))
    if long_t:
        report.add(_limits.long_t_table(long_t, forward_flops, peak))
    if gqa:
        report.add(_limits.gqa_backward_table(gqa, forward_flops, peak))
    if small:
        report.add(_limits.small_table(small, forward_flops, peak))
    report.print()
    report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
