"""The sections of `python -m flashattn bench` that hold the cpu engine to
the machine's limits, each measured beside torch SDPA and beside
the limit itself (read bandwidth or FMA peak) in the same run:

- decode: Tq in {1, 4} against Tk in {8192, 65536} keys, B in {1, 8},
  H = 32, Hkv = 8, D = 128, in float32 and bfloat16 (torch in the same
  dtype): GB/s of K and V read, against the read bandwidth measured
  between the cases;
- long-T: full attention, B = 1, H = 1, D = 64, T = 4096, 16384, 65536:
  GFLOP/s forward and forward + backward, against T = 4096;
- gqa-bwd: the backward at T = 4096, D in {64, 128}, causal and full, with
  Hkv = 2 against Hkv = 8 (H = 8, the same FLOPs);
- small: T <= 512, and B = 8 with T = 256, at D = 32 and 64: % of FMA peak
  forward and forward + backward, and the thread pool's wake-up cost.

Contenders are interleaved and the minimum of the runs is compared."""

from __future__ import annotations

import numpy as np

from .output import Column, Table, ms_runs

DECODE = [(dtype, B, Tk, Tq) for dtype in ("fp32", "bf16") for B in (1, 8)
          for Tk in (8192, 65536) for Tq in (1, 4)]
DECODE_HEADS = (32, 8, 128)  # H, Hkv, D
LONG_TS = [4096, 16384, 65536]
GQA_CASES = [(D, causal) for D in (64, 128) for causal in (True, False)]
SMALL = [(1, 256, 32), (1, 512, 32), (8, 256, 32), (1, 256, 64), (1, 512, 64), (8, 256, 64)]
SMALL_H = 8
CASES = {"decode": DECODE, "long-t": LONG_TS, "gqa-bwd": GQA_CASES, "small": SMALL}


def read_bandwidth(threads):
    from ... import _core

    return max(_core._cpu_read_bandwidth(0.25, threads) for _ in range(2))


def _gqa(H, Hkv):
    return H != Hkv


class Decode:
    """One decoding step: Tq new queries against a cache of Tk keys."""

    def __init__(self, dtype, B, Tk, Tq, torch):
        import flashattn as fa

        H, Hkv, D = DECODE_HEADS
        self.fa = fa
        rng = np.random.default_rng(0)
        self.q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
        self.k = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
        self.v = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
        self.torch = torch
        if torch is not None:
            torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32

            def t(x):
                return torch.from_numpy(x).to(torch_dtype).permute(0, 2, 1, 3).contiguous()

            self.tq, self.tk, self.tv = t(self.q), t(self.k), t(self.v)
        if dtype == "bf16":
            import ml_dtypes

            self.q, self.k, self.v = (x.astype(ml_dtypes.bfloat16) for x in (self.q, self.k, self.v))
        self.bytes = self.k.nbytes + self.v.nbytes

    def ours(self):
        self.fa.attention(self.q, self.k, self.v, backend="cpu")

    def theirs(self):
        torch = self.torch
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(self.tq, self.tk, self.tv,
                                                             enable_gqa=True)


def run_decode(args, torch, progress, interleaved):
    rows = []
    for dtype, B, Tk, Tq in DECODE:
        label = f"decode {dtype} B={B} Tk={Tk} Tq={Tq}"
        progress.step(label)
        prob = Decode(dtype, B, Tk, Tq, torch)
        fns = {"ours": prob.ours}
        if torch is not None:
            fns["torch"] = prob.theirs
        times = interleaved(fns, args.repeat, progress, label)
        bandwidth = read_bandwidth(args.threads)  # between the cases: the same conditions
        rows.append(((dtype, B, Tk, Tq), prob.bytes, times, bandwidth))
        del prob
    return rows


def decode_table(rows):
    H, Hkv, D = DECODE_HEADS
    table = Table("decode", f"decode, cpu engine: H={H}, Hkv={Hkv}, D={D}; GB/s of K and V read "
                  "(min of the runs; torch in the same dtype), against the read bandwidth "
                  "measured after each case",
                  [Column("dtype", "dtype"), Column("B", "B", "d"), Column("Tk", "Tk", "d"),
                   Column("Tq", "Tq", "d"), Column("ours_ms", "ours ms", ".2f"),
                   Column("ours_gbs", "GB/s", ".1f"), Column("torch_ms", "torch ms", ".2f"),
                   Column("torch_gbs", "GB/s", ".1f"), Column("speedup", "vs torch", "x"),
                   Column("bandwidth_gbs", "read bandwidth GB/s", ".1f"),
                   Column("share", "ours / bandwidth", "%")])
    shares = []
    for (dtype, B, Tk, Tq), nbytes, times, bw in rows:
        ours = min(times["ours"])
        row = {"dtype": dtype, "B": B, "Tk": Tk, "Tq": Tq, "ours_ms": ours * 1e3,
               "ours_gbs": nbytes / ours / 1e9, "bandwidth_gbs": bw,
               "share": nbytes / ours / 1e9 / bw, "bytes": nbytes, "ours_runs_ms": ms_runs(times["ours"])}
        if "torch" in times:
            th = min(times["torch"])
            row.update(torch_ms=th * 1e3, torch_gbs=nbytes / th / 1e9, speedup=th / ours,
                       torch_runs_ms=ms_runs(times["torch"]))
        shares.append(row["share"])
        table.add(row)
    table.note(f"lowest share of the read bandwidth: {100 * min(shares):.1f}%",
               lowest_share=min(shares))
    return table


def run_long_t(args, torch, progress, interleaved, Problem):
    rows = []
    for T in LONG_TS:
        progress.step(f"long-T T={T}")
        prob = Problem(1, T, 1, 1, 64, False, torch=torch)
        fns = {"ours fwd": prob.ours_forward, "ours fwd+bwd": prob.ours_forward_backward}
        if torch is not None and T <= args.long_t_torch:
            fns["torch fwd"] = prob.torch_forward
            fns["torch fwd+bwd"] = prob.torch_forward_backward
        rows.append((T, interleaved(fns, args.repeat, progress, f"long-T T={T}")))
        del prob
    return rows


def long_t_table(rows, forward_flops, peak):
    table = Table("long-t", "long T, cpu engine: B=1, H=1, D=64, full attention; GFLOP/s of "
                  f"visible work (min of the runs), % of the FMA peak {peak:.0f} GFLOP/s",
                  [Column("T", "T", "d"), Column("pass", "pass"),
                   Column("ours_gflops", "ours GFLOP/s", ".1f"), Column("ours_peak", "% peak", "%"),
                   Column("vs_first", f"vs T={LONG_TS[0]}", "x"),
                   Column("torch_gflops", "torch GFLOP/s", ".1f"),
                   Column("speedup", "vs torch", "x")])
    base = {}
    kept = []
    for T, times in rows:
        fl = forward_flops(1, T, T, 1, 64, False)
        for kind, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            ours = times[f"ours {kind}"]
            rate = mult * fl / min(ours) / 1e9
            base.setdefault(kind, rate)
            row = {"T": T, "pass": kind, "ours_gflops": rate, "ours_peak": rate / peak,
                   "vs_first": rate / base[kind], "ours_runs_ms": ms_runs(ours)}
            if T > LONG_TS[0]:
                kept.append(rate / base[kind])
            if f"torch {kind}" in times:
                th = times[f"torch {kind}"]
                trate = mult * fl / min(th) / 1e9
                row.update(torch_gflops=trate, speedup=rate / trate, torch_runs_ms=ms_runs(th))
            table.add(row)
    if kept:
        table.note(f"lowest throughput against T={LONG_TS[0]}: {min(kept):.2f}x",
                   lowest_vs_first=min(kept))
    return table


def run_gqa_backward(args, torch, progress, interleaved, Problem):
    rows = []
    for D, causal in GQA_CASES:
        label = f"gqa-bwd D={D} {'causal' if causal else 'full'}"
        progress.step(label)
        probs = {Hkv: Problem(1, 4096, 8, Hkv, D, causal, torch=torch) for Hkv in (8, 2)}
        outs = {Hkv: p.forward_outputs() for Hkv, p in probs.items()}
        fns = {f"ours bwd Hkv={Hkv}": (lambda p=p, o=outs[Hkv]: p.ours_backward(*o))
               for Hkv, p in probs.items()}
        if torch is not None:
            for Hkv, p in probs.items():
                fns[f"torch fwd+bwd Hkv={Hkv}"] = p.torch_forward_backward
        rows.append(((D, causal), interleaved(fns, args.repeat, progress, label)))
        del probs, outs
    return rows


def gqa_backward_table(rows, forward_flops, peak):
    table = Table("gqa-bwd", "GQA backward, cpu engine: B=1, T=4096, H=8, Hkv=2 against Hkv=8 (the "
                  "same FLOPs); backward GFLOP/s (2.5x forward FLOPs), min of the runs; "
                  "torch: forward + backward GFLOP/s",
                  [Column("D", "D", "d"), Column("mask", "mask"),
                   Column("mha_gflops", "MHA GFLOP/s", ".1f"),
                   Column("gqa_gflops", "GQA GFLOP/s", ".1f"), Column("gqa_vs_mha", "GQA/MHA", ".2f"),
                   Column("mha_peak", "MHA % peak", "%"),
                   Column("torch_mha_gflops", "torch MHA GFLOP/s", ".1f"),
                   Column("torch_gqa_gflops", "torch GQA GFLOP/s", ".1f")])
    ratios = []
    for (D, causal), times in rows:
        fl = 2.5 * forward_flops(1, 4096, 4096, 8, D, causal)
        mha = fl / min(times["ours bwd Hkv=8"]) / 1e9
        gqa = fl / min(times["ours bwd Hkv=2"]) / 1e9
        ratios.append(gqa / mha)
        row = {"D": D, "mask": "causal" if causal else "full", "mha_gflops": mha,
               "gqa_gflops": gqa, "gqa_vs_mha": gqa / mha, "mha_peak": mha / peak,
               "runs_ms": {name: ms_runs(ts) for name, ts in times.items()}}
        if "torch fwd+bwd Hkv=8" in times:
            f35 = 3.5 * fl / 2.5
            row.update(torch_mha_gflops=f35 / min(times["torch fwd+bwd Hkv=8"]) / 1e9,
                       torch_gqa_gflops=f35 / min(times["torch fwd+bwd Hkv=2"]) / 1e9)
        table.add(row)
    table.note(f"lowest GQA/MHA: {min(ratios):.2f}", lowest_gqa_vs_mha=min(ratios))
    return table


def run_small(args, torch, progress, interleaved, Problem):
    from ... import _core

    rows = []
    for B, T, D in SMALL:
        label = f"small B={B} T={T} D={D}"
        progress.step(label)
        prob = Problem(B, T, SMALL_H, SMALL_H, D, False, torch=torch)
        fns = {"ours fwd": prob.ours_forward, "ours fwd+bwd": prob.ours_forward_backward}
        if torch is not None:
            fns["torch fwd"] = prob.torch_forward
            fns["torch fwd+bwd"] = prob.torch_forward_backward
        rows.append(((B, T, D), interleaved(fns, args.repeat * 4, progress, label)))
    wake = min(_core._cpu_pool_wakeup_us(2000) for _ in range(5))
    return rows, wake


def small_table(result, forward_flops, peak):
    rows, wake = result
    table = Table("small", f"small shapes, cpu engine: H={SMALL_H}, full attention; % of the FMA "
                  f"peak {peak:.0f} GFLOP/s (min of the runs)",
                  [Column("B", "B", "d"), Column("T", "T", "d"), Column("D", "D", "d"),
                   Column("pass", "pass"), Column("ours_ms", "ours ms", ".3f"),
                   Column("ours_peak", "% peak", "%"), Column("torch_ms", "torch ms", ".3f"),
                   Column("torch_peak", "% peak", "%"), Column("speedup", "vs torch", "x")])
    shares = []
    for (B, T, D), times in rows:
        fl = forward_flops(B, T, T, SMALL_H, D, False)
        for kind, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            ours = min(times[f"ours {kind}"])
            row = {"B": B, "T": T, "D": D, "pass": kind, "ours_ms": ours * 1e3,
                   "ours_peak": mult * fl / ours / 1e9 / peak,
                   "ours_runs_ms": ms_runs(times[f"ours {kind}"])}
            shares.append(row["ours_peak"])
            if f"torch {kind}" in times:
                th = min(times[f"torch {kind}"])
                row.update(torch_ms=th * 1e3, torch_peak=mult * fl / th / 1e9 / peak,
                           speedup=th / ours, torch_runs_ms=ms_runs(times[f"torch {kind}"]))
            table.add(row)
    table.note(f"lowest share of the FMA peak: {100 * min(shares):.1f}%", lowest_share=min(shares))
    table.note(f"thread pool: a parallel_for of one 20 us task per thread takes {wake:.1f} us "
               "more than 20 us (best of 5 x 2000 calls)", pool_wakeup_us=wake)
    return table
