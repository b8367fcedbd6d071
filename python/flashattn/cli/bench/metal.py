"""`python -m flashattn bench --backend metal`: the metal engine against MLX
on the Apple GPU, with the cpu engine in the same run.

Competitors: ``mx.fast.scaled_dot_product_attention`` for the forward and
``mx.grad`` of it (the gradients of sum(o * do) with respect to q, k, v)
for forward + backward; both evaluated with ``mx.eval`` so the GPU work is
inside the timing. Every engine runs each shape once to warm up (pipeline
creation, MLX's graph compilation) and then ``--repeat`` times (at least 5),
interleaved, alternating the order every round; the table shows minima,
GFLOP/s and the ratios MLX / metal and cpu / metal (> 1: metal is faster).
``--json FILE`` writes every figure and each run's time.
FLOPs as in the cpu bench: forward 4*B*H*Tq*Tk*D, halved for causal;
backward 2.5x forward.

Then varlen on the metal engine (issue 34; `bench options`' one-launch
section with backend="metal"): 256 sequences of 64 tokens and a mixed
batch, each as one plan (one command buffer), as one engine call per
sequence, and as a dense batch of the same work.

Then, with MLX, the in-stream section (instream.py): a small transformer's
training step with flashattn.mlx running in MLX's own stream against the
same model on ``mx.fast.scaled_dot_product_attention``, time and peak
memory at T = 1k-16k (``--seqs``).

Without the metal engine (not macOS on Apple silicon, or built without the
Metal toolchain) it says so and exits with status 2: there is nothing of
the GPU to measure. With MLX it still runs the in-stream section as far as
metal-sim allows (T = 64, or ``--sim-seqs``), saying that the figures are
the simulator's. Without MLX (``pip install mlx``) it times the two
flashattn engines only.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from . import instream, options
from .cpu import forward_flops, interleaved
from .output import Column, Progress, Report, Table, ms_runs

# (B, Tq, Tk, H, Hkv, D, causal): training shapes, then decode against a KV
# cache: GQA (the tiled kernel), MHA (the vector kernel, against MLX's
# sdpa_vector: both take Tq <= 8 so).
SHAPES = [
    (1, 1024, 1024, 8, 8, 64, True),
    (1, 1024, 1024, 8, 8, 64, False),
    (1, 4096, 4096, 8, 8, 64, True),
    (4, 512, 512, 8, 8, 64, True),
    (1, 2048, 2048, 32, 8, 128, True),
    (8, 256, 256, 4, 4, 32, False),
    (1, 1, 8192, 32, 8, 128, False),
    (8, 4, 4096, 32, 8, 128, True),
    (1, 1, 8192, 32, 32, 128, False),
    (4, 2, 4096, 16, 16, 64, True),
]


class Problem:
    """One shape's inputs for flashattn (B, T, H, D) and MLX (B, H, T, D)."""

    def __init__(self, B, Tq, Tk, H, Hkv, D, causal, mx=None):
        import flashattn as fa

        self.fa, self.mx, self.causal = fa, mx, causal
        rng = np.random.default_rng(0)
        self.q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
        self.k = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
        self.v = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
        self.do = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
        self.scale = 1.0 / np.sqrt(D)
        if mx is not None:
            t = lambda x: mx.array(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))  # noqa: E731
            self.mq, self.mk, self.mv, self.mdo = t(self.q), t(self.k), t(self.v), t(self.do)
            mx.eval(self.mq, self.mk, self.mv, self.mdo)
            mask = "causal" if causal else None

            def loss(q, k, v):
                o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
                return (o * self.mdo).sum()

            self.mlx_grad = mx.grad(loss, argnums=(0, 1, 2))
            self.mask = mask

    def ours(self, backend):
        fa = self.fa

        def forward():
            fa.attention(self.q, self.k, self.v, causal=self.causal, backend=backend)

        def forward_backward():
            o, lse = fa.attention(self.q, self.k, self.v, causal=self.causal, return_lse=True,
                                  backend=backend)
            fa.attention_backward(self.do, self.q, self.k, self.v, o, lse, causal=self.causal,
                                  backend=backend)

        return forward, forward_backward

    def mlx_forward(self):
        mx = self.mx
        mx.eval(mx.fast.scaled_dot_product_attention(self.mq, self.mk, self.mv, scale=self.scale,
                                                     mask=self.mask))

    def mlx_forward_backward(self):
        self.mx.eval(*self.mlx_grad(self.mq, self.mk, self.mv))


def run(shapes, repeat, gpu="metal", cpu="cpu", mx=None, progress=None):
    """Times every shape; returns rows (shape, forward FLOPs, {name: [seconds]})."""
    progress = progress or Progress(len(shapes))
    rows = []
    for shape in shapes:
        B, Tq, Tk, H, Hkv, D, causal = shape
        label = f"{B}, {Tq}x{Tk}, {H}/{Hkv}, {D}, {'causal' if causal else 'full'}"
        progress.step(label)
        prob = Problem(*shape, mx=mx)
        fns = {}
        fns["metal fwd"], fns["metal fwd+bwd"] = prob.ours(gpu)
        fns["cpu fwd"], fns["cpu fwd+bwd"] = prob.ours(cpu)
        if mx is not None:
            fns["mlx fwd"], fns["mlx fwd+bwd"] = prob.mlx_forward, prob.mlx_forward_backward
        times = interleaved(fns, repeat, progress, label)
        rows.append((label, forward_flops(B, Tq, Tk, H, D, causal), times))
    progress.close()
    return rows


def metal_table(rows, have_mlx):
    cols = [Column("shape", "B, Tq x Tk, H/Hkv, D, mask"), Column("pass", "pass"),
            Column("metal_ms", "metal ms", ".2f"), Column("metal_gflops", "GFLOP/s", ".0f"),
            Column("cpu_ms", "cpu ms", ".2f"), Column("cpu_vs_metal", "cpu/metal", "x")]
    if have_mlx:
        cols += [Column("mlx_ms", "mlx ms", ".2f"), Column("mlx_vs_metal", "mlx/metal", "x")]
    table = Table("metal", "metal engine against the cpu engine and MLX: min of the interleaved "
                  "runs; a ratio > 1 means metal is faster", cols)
    for label, fl, times in rows:
        for c in ("fwd", "fwd+bwd"):
            flops = fl * (3.5 if c == "fwd+bwd" else 1.0)
            metal, cpu = min(times[f"metal {c}"]), min(times[f"cpu {c}"])
            row = {"shape": label, "pass": c, "metal_ms": metal * 1e3,
                   "metal_gflops": flops / metal / 1e9, "cpu_ms": cpu * 1e3,
                   "cpu_vs_metal": cpu / metal,
                   "runs_ms": {name: ms_runs(ts) for name, ts in times.items()
                               if name.endswith(f" {c}")}}
            if have_mlx:
                mlx = min(times[f"mlx {c}"])
                row.update(mlx_ms=mlx * 1e3, mlx_vs_metal=mlx / metal)
            table.add(row)
    return table


def print_table(rows, have_mlx, out=sys.stdout):
    metal_table(rows, have_mlx).print(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashattn bench --backend metal",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["metal"], default="metal")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (>= 5)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure, each run's "
                        "time and the machine's description to FILE (JSON)")
    parser.add_argument("--seqs", type=_seqs, default=instream.MAC_SEQS,
                        help="sequence lengths of the in-stream training step on a Mac "
                             "(comma-separated; default 1024,...,16384)")
    parser.add_argument("--sim-seqs", type=_seqs, default=instream.SIM_SEQS,
                        help="the same without Metal, on metal-sim (default 64)")
    args = parser.parse_args(argv)
    if args.repeat < 5:
        parser.error("--repeat must be at least 5")

    import flashattn as fa

    if "metal" not in fa.backends():
        print("cannot run the Metal benchmark: the metal engine is not available here "
              f"(engines: {', '.join(fa.backends())}). It needs macOS 14+ on Apple silicon and a "
              "build with the Metal toolchain; see docs/metal.md.", file=sys.stderr)
        if _have_mlx():
            instream.main(args.sim_seqs, args.repeat, on_sim=True)
        return 2
    try:
        import mlx.core as mx

        note = f"MLX {mx.__version__} mx.fast.scaled_dot_product_attention (and mx.grad of it)"
    except ImportError:
        mx = None
        note = "MLX not installed (pip install mlx): flashattn's engines only"
    rows = run(SHAPES, args.repeat, mx=mx)
    device = fa.metal_pool_stats().get("device", "?")
    report = Report(f"bench --backend metal: the metal engine on {device} against MLX and the "
                    "cpu engine", {"dtype": "float32", "repeat": args.repeat,
                                   "threads": fa.get_num_threads(), "device": device})
    report.line(f"competitor: {note}, and the cpu engine ({fa.get_num_threads()} threads)",
                competitor=note)
    report.line(f"float32, {args.repeat} timed runs per case after a warm-up, engines "
                "interleaved, minimum shown")
    report.add(metal_table(rows, mx is not None))
    # Varlen on the metal engine (issue 34): one plan per call against one
    # engine call (command buffer, wait) per sequence, and a dense batch.
    progress = Progress(1)
    report.add(options.one_launch_section(args.repeat, progress, backend="metal"))
    progress.close()
    report.print()
    report.write_json(args.json)
    if mx is not None:
        from ..._instream import mlx_stream

        if mlx_stream.host() is not None:
            instream.main(args.seqs, args.repeat, on_sim=False)
        else:
            print("\nno in-stream section: MLX's Metal back end is not in use here "
                  f"(default device {mx.default_device()})")
    return 0


def _seqs(text: str) -> tuple:
    try:
        seqs = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths, got {text!r}")
    if not seqs or min(seqs) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be positive, got {text!r}")
    return seqs


def _have_mlx() -> bool:
    try:
        import mlx.core  # noqa: F401
    except ImportError:
        return False
    return True
