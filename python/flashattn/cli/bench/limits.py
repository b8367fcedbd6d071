"""The sections of `python -m flashattn bench` that hold the cpu engine to
the machine's limits (issue 14), each measured beside torch SDPA and beside
the limit itself (read bandwidth or FMA peak) in the same run:

- decode: Tq in {1, 4} against Tk in {8192, 65536} keys, B in {1, 8},
  H = 32, Hkv = 8, D = 128, in float32 and bfloat16 (torch in the same
  dtype): GB/s of K and V read, against the read bandwidth measured
  between the cases (goal: >= 70 %);
- long-T: full attention, B = 1, H = 1, D = 64, T = 4096, 16384, 65536:
  GFLOP/s forward and forward + backward (goal: T >= 16384 within 10 % of
  T = 4096);
- gqa-bwd: the backward at T = 4096, D in {64, 128}, causal and full, with
  Hkv = 2 against Hkv = 8 (H = 8, the same FLOPs; goal: within 5 %);
- small: T <= 512, and B = 8 with T = 256, at D = 32 and 64: % of FMA peak
  forward and forward + backward (goal: >= 45 %), and the thread pool's
  wake-up cost.

Contenders are interleaved and the minimum of the runs is compared."""

from __future__ import annotations

import math

import numpy as np

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


def print_decode(rows):
    H, Hkv, D = DECODE_HEADS
    print(f"\ndecode, cpu engine: H={H}, Hkv={Hkv}, D={D}; GB/s of K and V read "
          "(min of the runs; torch in the same dtype), against the read bandwidth measured "
          "after each case")
    head = (f"{'dtype':<5} {'B':>2} {'Tk':>6} {'Tq':>3} {'ours ms':>9} {'GB/s':>6} {'torch ms':>9} "
            f"{'GB/s':>6} {'vs torch':>8} {'bandwidth':>9} {'ours/bw':>7}")
    print(head)
    print("-" * len(head))
    worst = math.inf
    for (dtype, B, Tk, Tq), nbytes, times, bw in rows:
        ours = min(times["ours"])
        line = f"{dtype:<5} {B:>2} {Tk:>6} {Tq:>3} {ours * 1e3:9.2f} {nbytes / ours / 1e9:6.1f}"
        if "torch" in times:
            th = min(times["torch"])
            line += f" {th * 1e3:9.2f} {nbytes / th / 1e9:6.1f} {th / ours:7.2f}x"
        else:
            line += f" {'-':>9} {'-':>6} {'-':>8}"
        share = nbytes / ours / 1e9 / bw
        worst = min(worst, share)
        line += f" {bw:7.1f} GB/s {100 * share:5.1f}%"
        print(line)
    verdict = "met" if worst >= 0.70 else "NOT met"
    print(f"lowest share of the read bandwidth: {100 * worst:.1f}% (goal >= 70%: {verdict})")


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


def print_long_t(rows, forward_flops, peak):
    print("\nlong T, cpu engine: B=1, H=1, D=64, full attention; GFLOP/s of visible work "
          f"(min of the runs), % of the FMA peak {peak:.0f} GFLOP/s")
    head = (f"{'T':>6} {'pass':<8} {'ours GFLOP/s':>12} {'%peak':>6} {'vs T=4096':>9} "
            f"{'torch GFLOP/s':>13} {'vs torch':>8}")
    print(head)
    print("-" * len(head))
    base = {}
    worst = math.inf
    for T, times in rows:
        fl = forward_flops(1, T, T, 1, 64, False)
        for kind, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            rate = mult * fl / min(times[f"ours {kind}"]) / 1e9
            base.setdefault(kind, rate)
            rel = rate / base[kind]
            if T > LONG_TS[0]:
                worst = min(worst, rel)
            line = f"{T:>6} {kind:<8} {rate:12.1f} {100 * rate / peak:5.1f}% {rel:8.2f}x"
            if f"torch {kind}" in times:
                trate = mult * fl / min(times[f"torch {kind}"]) / 1e9
                line += f" {trate:13.1f} {rate / trate:7.2f}x"
            else:
                line += f" {'(skipped)':>13} {'-':>8}"
            print(line)
    verdict = "met" if worst >= 0.90 else "NOT met"
    print(f"lowest throughput against T={LONG_TS[0]}: {worst:.2f}x (goal >= 0.90x: {verdict})")


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


def print_gqa_backward(rows, forward_flops, peak):
    print("\nGQA backward, cpu engine: B=1, T=4096, H=8, Hkv=2 against Hkv=8 (the same FLOPs); "
          "backward GFLOP/s (2.5x forward FLOPs), min of the runs")
    head = (f"{'D':>4} {'mask':<7} {'MHA GFLOP/s':>11} {'GQA GFLOP/s':>11} {'GQA/MHA':>7} "
            f"{'torch f+b MHA':>13} {'GQA':>7}")
    print(head)
    print("-" * len(head))
    worst = math.inf
    for (D, causal), times in rows:
        fl = 2.5 * forward_flops(1, 4096, 4096, 8, D, causal)
        mha = fl / min(times["ours bwd Hkv=8"]) / 1e9
        gqa = fl / min(times["ours bwd Hkv=2"]) / 1e9
        worst = min(worst, gqa / mha)
        line = f"{D:>4} {'causal' if causal else 'full':<7} {mha:11.1f} {gqa:11.1f} {gqa / mha:7.2f}"
        if "torch fwd+bwd Hkv=8" in times:
            f35 = 3.5 * fl / 2.5
            line += (f" {f35 / min(times['torch fwd+bwd Hkv=8']) / 1e9:13.1f}"
                     f" {f35 / min(times['torch fwd+bwd Hkv=2']) / 1e9:7.1f}")
        print(line)
    print(f"(FMA peak {peak:.0f} GFLOP/s) lowest GQA/MHA: {worst:.2f} "
          f"(goal >= 0.95: {'met' if worst >= 0.95 else 'NOT met'})")


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


def print_small(result, forward_flops, peak):
    rows, wake = result
    print(f"\nsmall shapes, cpu engine: H={SMALL_H}, full attention; % of the FMA peak "
          f"{peak:.0f} GFLOP/s (min of the runs)")
    head = (f"{'B':>2} {'T':>4} {'D':>3} {'pass':<8} {'ours ms':>8} {'%peak':>6} {'torch ms':>8} "
            f"{'%peak':>6} {'vs torch':>8}")
    print(head)
    print("-" * len(head))
    worst = math.inf
    for (B, T, D), times in rows:
        fl = forward_flops(B, T, T, SMALL_H, D, False)
        for kind, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            ours = min(times[f"ours {kind}"])
            share = mult * fl / ours / 1e9 / peak
            worst = min(worst, share)
            line = f"{B:>2} {T:>4} {D:>3} {kind:<8} {ours * 1e3:8.3f} {100 * share:5.1f}%"
            if f"torch {kind}" in times:
                th = min(times[f"torch {kind}"])
                line += f" {th * 1e3:8.3f} {100 * mult * fl / th / 1e9 / peak:5.1f}% {th / ours:7.2f}x"
            print(line)
    print(f"lowest share of the FMA peak: {100 * worst:.1f}% "
          f"(goal >= 45%: {'met' if worst >= 0.45 else 'NOT met'})")
    print(f"thread pool: a parallel_for of one 20 us task per thread takes {wake:.1f} us more "
          "than 20 us (best of 5 x 2000 calls)")
