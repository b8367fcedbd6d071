"""Issue 36 probe: where the cpu engine loses on a many-core machine.

Per shape and dtype: forward and backward alone at 1 and N threads (min of
the runs), the per-thread throughput kept, and with FLASHATTN_CPU_PROFILE=1
the pool's record of each parallel_for in the N-thread calls (tasks,
utilisation = busy / (threads x wall), longest task / wall). torch SDPA
beside it where --torch is given. Prints one line per measurement."""
import argparse
import os
import sys
import time

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import ml_dtypes  # noqa: E402

import flashattn as fa  # noqa: E402
from flashattn import _core  # noqa: E402

SHAPES = [(1, 1024, 8, 8, 64, True), (1, 1024, 8, 8, 64, False), (1, 4096, 8, 8, 64, True),
          (4, 512, 8, 8, 64, True), (1, 2048, 32, 8, 128, True), (8, 256, 4, 4, 32, False),
          (2, 4096, 16, 4, 128, True)]


def best(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def profile_line():
    if not hasattr(_core, "_cpu_pool_profile"):
        return ""
    rows = _core._cpu_pool_profile()
    if not rows:
        return ""
    parts = []
    for tasks, threads, wall, busy, longest in rows[-4:]:
        parts.append(f"[{int(tasks)} tasks {wall * 1e3:.2f} ms util {busy / (threads * wall):.2f} "
                     f"longest {longest / wall:.2f}]")
    return " " + " ".join(parts)


def arrays(B, T, H, Hkv, D, dtype, Tq=None):
    rng = np.random.default_rng(0)
    Tq = Tq or T
    npd = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}[dtype]
    # uniform in [-1.7, 1.7) (variance 1): several times faster to draw than
    # normals, which matters for the 4 GB decode caches
    f32 = [(rng.random(s, dtype=np.float32) - 0.5) * 3.4
           for s in ((B, Tq, H, D), (B, T, Hkv, D), (B, T, Hkv, D), (B, Tq, H, D))]
    return f32, [x.astype(npd) for x in f32]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--only", default="peak,scaling,longt,decode,wake")
    a = ap.parse_args()
    only = set(a.only.split(","))
    N = a.threads
    torch = None
    if a.torch:
        import torch
    L = a.label
    print(f"{L} isa {fa.cpu_isa()} threads {N}", flush=True)
    if "peak" in only:
        for t in (1, N):
            pk = max(_core._cpu_fma_peak(0.3, t) for _ in range(3))
            bw = max(_core._cpu_read_bandwidth(0.25, t) for _ in range(2))
            print(f"{L} peak threads={t} fma {pk:.1f} GFLOP/s read {bw:.1f} GB/s", flush=True)
    if "wake" in only:
        for t in (2, 4, 8, N):
            fa.set_num_threads(t)
            w = min(_core._cpu_pool_wakeup_us(2000) for _ in range(5))
            print(f"{L} wake threads={t} {w:.2f} us", flush=True)
    if "scaling" in only:
        for dtype in ("fp32", "bf16"):
            for shape in SHAPES:
                B, T, H, Hkv, D, causal = shape
                f32, (q, k, v, do) = arrays(B, T, H, Hkv, D, dtype)
                fl = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
                rates = {}
                for t in (1, N):
                    fa.set_num_threads(t)
                    reps = 3 if t == 1 else 7
                    tf = best(lambda: fa.attention(q, k, v, causal=causal, backend="cpu"), reps)
                    o, lse = fa.attention(q, k, v, causal=causal, return_lse=True, backend="cpu")
                    if hasattr(_core, "_cpu_pool_profile"):
                        _core._cpu_pool_profile()
                    fa.attention(q, k, v, causal=causal, backend="cpu")
                    pf = profile_line() if t > 1 else ""
                    tb = best(lambda: fa.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                            backend="cpu"), reps)
                    if hasattr(_core, "_cpu_pool_profile"):
                        _core._cpu_pool_profile()
                    fa.attention_backward(do, q, k, v, o, lse, causal=causal, backend="cpu")
                    pb = profile_line() if t > 1 else ""
                    rates[t] = (fl / tf / 1e9, 2.5 * fl / tb / 1e9)
                    print(f"{L} {dtype} {shape} threads={t} fwd {tf * 1e3:.2f} ms "
                          f"{rates[t][0]:.1f} GF/s; bwd {tb * 1e3:.2f} ms {rates[t][1]:.1f} GF/s"
                          f"{' fwdprof' + pf if pf else ''}{' bwdprof' + pb if pb else ''}",
                          flush=True)
                    if torch is not None and (t == N or shape[1] == 4096 and shape[0] == 2):
                        torch.set_num_threads(t)
                        thd = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
                        tq, tk, tv, tdo = (torch.from_numpy(x).permute(0, 2, 1, 3).contiguous()
                                           .to(thd) for x in f32)
                        tqg, tkg, tvg = (x.clone().requires_grad_() for x in (tq, tk, tv))

                        def tfwd():
                            with torch.no_grad():
                                torch.nn.functional.scaled_dot_product_attention(
                                    tq, tk, tv, is_causal=causal, enable_gqa=H != Hkv)

                        def tfb():
                            out = torch.nn.functional.scaled_dot_product_attention(
                                tqg, tkg, tvg, is_causal=causal, enable_gqa=H != Hkv)
                            torch.autograd.grad(out, (tqg, tkg, tvg), tdo)
                        ttf = best(tfwd, reps)
                        ttfb = best(tfb, reps)
                        print(f"{L} torch {dtype} {shape} threads={t} fwd {ttf * 1e3:.2f} ms; "
                              f"fwd+bwd {ttfb * 1e3:.2f} ms", flush=True)
                kept = (rates[N][0] / (N * rates[1][0]), rates[N][1] / (N * rates[1][1]))
                print(f"{L} {dtype} {shape} kept fwd {kept[0]:.2f} bwd {kept[1]:.2f}", flush=True)
    if "longt" in only:
        fa.set_num_threads(N)
        for T in (4096, 16384, 65536):
            f32, (q, k, v, do) = arrays(1, T, 1, 1, 64, "fp32")
            fl = 4.0 * T * T * 64
            reps = 3 if T < 65536 else 2
            tf = best(lambda: fa.attention(q, k, v, backend="cpu"), reps)
            o, lse = fa.attention(q, k, v, return_lse=True, backend="cpu")
            if hasattr(_core, "_cpu_pool_profile"):
                _core._cpu_pool_profile()
            tb = best(lambda: fa.attention_backward(do, q, k, v, o, lse, backend="cpu"), reps)
            pb = profile_line()
            print(f"{L} longT T={T} fwd {fl / tf / 1e9:.1f} GF/s bwd {2.5 * fl / tb / 1e9:.1f} GF/s "
                  f"fwd+bwd {3.5 * fl / (tf + tb) / 1e9:.1f} GF/s{' bwdprof' + pb if pb else ''}",
                  flush=True)
    if "decode" in only:
        fa.set_num_threads(N)
        for dtype in ("fp32", "bf16", "fp16"):
            for B in (1, 8):
                for Tk in (8192, 65536):
                    for Tq in (1, 4):
                        f32, (q, k, v, do) = arrays(B, Tk, 32, 8, 128, dtype, Tq=Tq)
                        if hasattr(_core, "_cpu_pool_profile"):
                            _core._cpu_pool_profile()
                        t = best(lambda: fa.attention(q, k, v, backend="cpu"), 7)
                        pf = profile_line()
                        gbs = (k.nbytes + v.nbytes) / t / 1e9
                        print(f"{L} decode {dtype} B={B} Tk={Tk} Tq={Tq} {t * 1e3:.3f} ms "
                              f"{gbs:.1f} GB/s{pf}", flush=True)


if __name__ == "__main__":
    main()
