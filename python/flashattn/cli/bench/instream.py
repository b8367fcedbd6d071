"""The in-stream section of `python -m flashattn bench --backend metal`: a
training step of a small MLX transformer (2 layers, d_model 256, 4 heads of
64, causal, float32, batch 1, Adam) with flashattn.mlx's attention running
in MLX's stream (fused forward and backward) against the same model with
``mx.fast.scaled_dot_product_attention`` (fused forward, backward unfused
by MLX's autodiff, which holds the T x T probabilities), at T = 1k to 16k:
milliseconds per step (forward, backward, optimizer update, ``mx.eval``)
and MLX's peak memory during a step.

On a Mac with MLX's GPU this measures the real thing. Elsewhere metal-sim
stands in for the GPU (flashattn._instream.sim): the same code path up to
the dispatch, run on the CPU, so only short sequences are feasible and the
times and memory are the simulator's and MLX's CPU backend's, printed as
such, never as GPU figures.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from .output import Progress

# (layers, d_model, heads, vocab): D = d_model / heads = 64.
MODEL = dict(layers=2, d_model=256, heads=4, vocab=256)
MAC_SEQS = (1024, 2048, 4096, 8192, 16384)
SIM_SEQS = (64,)
ATTENTIONS = ("flashattn", "mlx sdpa")


def _model(mx, nn, attention: str, layers, d_model, heads, vocab):
    """A decoder-only transformer whose attention is flashattn.mlx's or MLX's fused SDPA."""
    import flashattn.mlx as fam

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
            self.out = nn.Linear(d_model, d_model, bias=False)
            self.mlp1, self.mlp2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

        def __call__(self, x):
            B, T, _ = x.shape
            qkv = self.qkv(self.norm1(x)).reshape(B, T, 3, heads, d_model // heads)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, H, D)
            if attention == "flashattn":
                o = fam.attention(q, k, v, causal=True)
            else:
                t = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731  MLX's (B, H, T, D)
                o = t(mx.fast.scaled_dot_product_attention(
                    t(q), t(k), t(v), scale=(d_model // heads) ** -0.5, mask="causal"))
            x = x + self.out(o.reshape(B, T, d_model))
            return x + self.mlp2(nn.gelu(self.mlp1(self.norm2(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.blocks = [Block() for _ in range(layers)]
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.head(self.norm(x))

    return Model()


def _peak(mx) -> int:
    get = getattr(mx, "get_peak_memory", None) or mx.metal.get_peak_memory
    return int(get())


def _reset_peak(mx) -> None:
    reset = getattr(mx, "reset_peak_memory", None) or mx.metal.reset_peak_memory
    reset()


def _trainer(mx, nn, optim, attention: str, T: int, seed: int = 0):
    """A step function of one model and optimizer (same seed, same data)."""
    mx.random.seed(seed)
    model = _model(mx, nn, attention, **MODEL)
    mx.eval(model.parameters())
    optimizer = optim.Adam(learning_rate=1e-3)
    rng = np.random.default_rng(seed)
    tokens = mx.array(rng.integers(0, MODEL["vocab"], (1, T + 1)).astype(np.int32))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    grad = nn.value_and_grad(model, loss_fn)

    def step():
        loss, grads = grad(model, x, y)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        return float(loss)

    return step


def run(seqs, repeat: int, progress=None, on_sim: bool = False):
    """Rows (T, {attention: (seconds, peak bytes, loss) or the error})."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from ..._instream import mlx_stream, sim

    saved = mlx_stream.HOST
    if on_sim:
        mlx_stream.HOST = mlx_stream.Host(sim.metal_kernel)
    progress = progress or Progress(len(seqs))
    rows = []
    try:
        for T in seqs:
            progress.step(f"training step, T = {T}")
            steps, result = {}, {}
            for name in ATTENTIONS:
                try:
                    steps[name] = _trainer(mx, nn, optim, name, T)
                    steps[name]()  # warm-up (kernel compilation, graph building)
                except Exception as e:  # noqa: BLE001 (MLX's out-of-memory, a refusal)
                    result[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
            times = {name: [] for name in steps}
            peaks = {name: 0 for name in steps}
            losses = {}
            for r in range(repeat):
                for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
                    if name in result:
                        continue
                    try:
                        _reset_peak(mx)
                        start = time.perf_counter()
                        losses[name] = steps[name]()
                        times[name].append(time.perf_counter() - start)
                        peaks[name] = max(peaks[name], _peak(mx))
                    except Exception as e:  # noqa: BLE001
                        result[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
            for name in steps:
                if name not in result:
                    result[name] = (min(times[name]), peaks[name], losses[name])
            rows.append((T, result))
    finally:
        mlx_stream.HOST = saved
        progress.close()
    return rows


def print_table(rows, out=None) -> None:
    """The rows as a table: each attention's time and peak, their ratios
    (> 1: flashattn is faster / smaller), and how far the final losses differ."""
    out = out or sys.stdout
    head = ("| T | flashattn ms/step | flashattn peak MiB | mlx sdpa ms/step | mlx sdpa peak MiB "
            "| time sdpa/flashattn | memory sdpa/flashattn | loss rel. diff |")
    print(head, file=out)
    print("|" + " --- |" * (head.count("|") - 1), file=out)
    for T, result in rows:
        cells = []
        for name in ATTENTIONS:
            r = result[name]
            cells += ([f"{r[0] * 1e3:.1f}", f"{r[1] / 2**20:.0f}"] if isinstance(r, tuple)
                      else [r, "-"])
        a, b = result["flashattn"], result["mlx sdpa"]
        if isinstance(a, tuple) and isinstance(b, tuple):
            # The same model, data and steps: the losses must agree.
            cells += [f"{b[0] / a[0]:.2f}x", f"{b[1] / a[1]:.2f}x" if a[1] else "-",
                      f"{abs(a[2] - b[2]) / max(abs(b[2]), 1e-30):.1e}"]
        else:
            cells += ["-", "-", "-"]
        print(f"| {T} | " + " | ".join(cells) + " |", file=out)


def main(seqs, repeat: int, on_sim: bool, out=None) -> int:
    import mlx.core as mx

    out = out or sys.stdout
    m = MODEL
    where = ("metal-sim standing in for the GPU (no Metal here): times and memory are the "
             "simulator's and MLX's CPU backend's, not a GPU's; T = 1k-16k needs a Mac"
             if on_sim else f"MLX {mx.__version__} on the GPU")
    print(f"\nTraining step of a {m['layers']}-layer transformer (d_model {m['d_model']}, "
          f"{m['heads']} heads of {m['d_model'] // m['heads']}, causal, float32, batch 1, Adam): "
          f"flashattn.mlx in MLX's stream vs mx.fast.scaled_dot_product_attention; {where}. "
          f"Minimum of {repeat} steps after a warm-up, interleaved; peak memory is MLX's "
          "during a step.", file=out)
    print_table(run(seqs, repeat, on_sim=on_sim), out=out)
    return 0
