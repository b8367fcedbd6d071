"""Issue 36 A/B: one build of flashattn (whichever is on PYTHONPATH) against
torch SDPA in the same process, interleaved (the bench's Problem and
interleaved()), at the given thread counts: forward, forward + backward and
the backward alone, minimum of --repeat runs, with the FMA peak measured in
the same run. Run it once per build; the builds compare through their
ratios to torch and to the peak. One line per shape and thread count."""
import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import flashattn as fa  # noqa: E402
from flashattn import _core  # noqa: E402
from flashattn.cli.bench.cpu import Problem, forward_flops, interleaved  # noqa: E402

SHAPES = {
    "issue": [(2, 4096, 16, 4, 128, True)],
    "table": [(1, 1024, 8, 8, 64, True), (1, 1024, 8, 8, 64, False), (1, 4096, 8, 8, 64, True),
              (4, 512, 8, 8, 64, True), (1, 2048, 32, 8, 128, True), (8, 256, 4, 4, 32, False)],
}


class Quiet:
    def note(self, *_):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", default="16")
    ap.add_argument("--shapes", default="issue")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-bwd", action="store_true", help="leave out the backward alone")
    a = ap.parse_args()
    import torch

    for t in (int(x) for x in a.threads.split(",")):
        fa.set_num_threads(t)
        torch.set_num_threads(t)
        peak = max(_core._cpu_fma_peak(0.3, t) for _ in range(2))
        print(f"{a.label} threads={t} fma peak {peak:.1f} GFLOP/s", flush=True)
        for shape in (s for name in a.shapes.split(",") for s in SHAPES[name]):
            B, T, H, Hkv, D, causal = shape
            pr = Problem(*shape, torch=torch, dtype=a.dtype)
            o, lse = pr.forward_outputs()
            fns = {"fwd": pr.ours_forward, "fb": pr.ours_forward_backward,
                   "bwd": lambda: pr.ours_backward(o, lse),
                   "tfwd": pr.torch_forward, "tfb": pr.torch_forward_backward}
            if a.no_bwd:
                del fns["bwd"]
            tm = {k: min(v) for k, v in interleaved(fns, a.repeat, Quiet(), "").items()}
            tm.setdefault("bwd", float("nan"))
            fl = forward_flops(B, T, T, H, D, causal)
            print(f"{a.label} {a.dtype} threads={t} {shape} "
                  f"fwd {tm['fwd'] * 1e3:.2f} ms ({fl / tm['fwd'] / 1e9 / peak:.0%} peak, "
                  f"{tm['tfwd'] / tm['fwd']:.2f}x torch) "
                  f"fwd+bwd {tm['fb'] * 1e3:.2f} ms ({3.5 * fl / tm['fb'] / 1e9 / peak:.0%} peak, "
                  f"{tm['tfb'] / tm['fb']:.2f}x torch) "
                  f"bwd {tm['bwd'] * 1e3:.2f} ms ({2.5 * fl / tm['bwd'] / 1e9 / peak:.0%} peak) "
                  f"torch {tm['tfwd'] * 1e3:.2f} / {tm['tfb'] * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
