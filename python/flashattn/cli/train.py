"""`python -m flashattn train`: a small character-level transformer trained in
PyTorch twice from the same seed, once with flashattn's attention
(flashattn.torch, fused forward and backward) and once with torch's
scaled_dot_product_attention, then both loss curves, step times and peak
memory side by side. ``--dtype bf16`` trains both in bfloat16 (autocast:
the weights and the optimizer in float32, the matrix products and the
attention in bfloat16, as mixed-precision training does).

Each run is a fresh subprocess (this module with ``--worker NAME``), so that
its peak memory is its own; the parent steps the two alternately, so that
both step times are taken under the same machine load, and prints the
comparison. The text is
shipped in the package (data/fables.txt, written for this project and
dedicated to the public domain). Needs torch (``pip install '.[torch]'``),
and matplotlib for ``--plot``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

TEXT = Path(__file__).with_name("data") / "fables.txt"
ATTENTIONS = ("flashattn", "sdpa")
# Relative difference allowed between the two final losses, per dtype: in
# bfloat16 (8 bits of mantissa) the two runs round differently from the
# first step on, and the curves drift apart by more.
AGREEMENT = {"fp32": 1e-3, "bf16": 2e-2}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashattn train",
        description="Train a small character-level transformer with flashattn's attention and "
                    "with torch SDPA from the same seed; compare losses, step time, memory.")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256, help="context length T")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device: cpu, or mps on a Mac")
    p.add_argument("--dtype", choices=tuple(AGREEMENT), default="fp32",
                   help="fp32, or bf16: autocast to bfloat16 (attention in bfloat16 too)")
    p.add_argument("--plot", metavar="FILE.png", help="draw both loss curves (needs matplotlib)")
    p.add_argument("--worker", choices=ATTENTIONS, help=argparse.SUPPRESS)
    return p


def _check(args) -> None:
    for name in ("steps", "batch", "seq", "layers", "d_model", "heads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"train: --{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    if args.d_model % args.heads:
        raise SystemExit(f"train: --d-model ({args.d_model}) must be a multiple of --heads "
                         f"({args.heads})")


# ----------------------------------------------------------------- the model

def _model(torch, vocab: int, args, attention):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = args.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            B, T, d = x.shape
            # (B, T, 3, H, D) -> three (B, H, T, D) views: torch's layout.
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, args.heads, d // args.heads).unbind(2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            y = attention(q, k, v).transpose(1, 2).reshape(B, T, d)
            x = x + self.proj(y)
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, args.d_model)
            self.pos = nn.Embedding(args.seq, args.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.ln = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, vocab)

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits.view(-1, vocab), targets.reshape(-1))

    return GPT()


def _attention(torch, name: str, calls: list):
    """The run's attention, counting its calls and noting the dtype of its
    inputs (so the report shows which ran, and in what)."""
    if name == "flashattn":
        from .. import torch as fat

        def attend(q, k, v):
            return fat.attention(q, k, v, causal=True, layout="bhtd")
    else:
        def attend(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def counted(q, k, v):
        calls[0] += 1
        calls[1] = str(q.dtype).replace("torch.", "")
        return attend(q, k, v)

    return counted


# ------------------------------------------------------------------ one run

def _rss_mib() -> float:
    """This process's peak resident memory (host memory only: on MPS the
    device's allocations are not in it)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (1024 * 1024) if sys.platform == "darwin" else kib / 1024


def _progress(step: int, steps: int, records: dict) -> None:
    width = 20
    done = width * step // steps
    cells = "  ".join(f"{name} loss {r['loss']:.4f} {1e3 * r['seconds']:4.0f} ms"
                      for name, r in records.items())
    line = f"[{'#' * done}{'.' * (width - done)}] {step:>4}/{steps}  {cells}"
    if sys.stderr.isatty():
        print("\r" + line, end="\n" if step == steps else "", file=sys.stderr, flush=True)
    elif step == steps or step % max(1, steps // 10) == 0:
        print(line, file=sys.stderr, flush=True)


def _worker(args) -> dict:
    import numpy as np
    import torch

    text = TEXT.read_text(encoding="utf-8")
    chars = sorted(set(text))
    if len(chars) > 256:
        raise SystemExit("train: the text has more than 256 distinct characters")
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], dtype=np.uint8)
    if len(data) <= args.seq + 1:
        raise SystemExit(f"train: --seq {args.seq} is longer than the text ({len(data)} chars)")
    device = torch.device(args.device)

    torch.manual_seed(args.seed)
    calls = [0, ""]
    model = _model(torch, len(chars), args, _attention(torch, args.worker, calls)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = np.random.default_rng(args.seed)  # the same batches for both runs
    rss_before = _rss_mib()
    precision = (torch.autocast(device_type=device.type, dtype=torch.bfloat16)
                 if args.dtype == "bf16" else contextlib.nullcontext())

    # Lock-step with the parent: one step per line read, one JSON line per
    # step written, so the two runs alternate under the same machine load.
    losses, times = [], []
    for _ in range(args.steps):
        if not sys.stdin.readline():
            raise SystemExit("train: the parent process went away")
        start = batches.integers(0, len(data) - args.seq - 1, size=args.batch)
        rows = np.stack([data[s:s + args.seq + 1] for s in start]).astype(np.int64)
        xy = torch.from_numpy(rows).to(device)
        t0 = time.perf_counter()
        with precision:
            loss = model(xy[:, :-1], xy[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.detach().item()  # waits for the device
        times.append(time.perf_counter() - t0)
        losses.append(value)
        print(json.dumps(dict(loss=value, seconds=times[-1])), flush=True)
    return dict(attention=args.worker, attention_calls=calls[0], attention_dtype=calls[1],
                losses=losses,
                step_seconds=times,
                rss_before_mib=rss_before, rss_peak_mib=_rss_mib(),
                parameters=sum(p.numel() for p in model.parameters()),
                threads=torch.get_num_threads(), torch=torch.__version__)


# --------------------------------------------------------- the comparison

def _worker_argv(args) -> list[str]:
    names = ("steps", "batch", "seq", "layers", "d_model", "heads", "lr", "seed", "device",
             "dtype")
    return [x for n in names for x in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]


def _run_interleaved(args) -> dict:
    """Both runs, each in its own process, stepped alternately."""
    workers = {}
    for name in ATTENTIONS:
        cmd = [sys.executable, "-m", "flashattn.cli.train", *_worker_argv(args), "--worker", name]
        workers[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)

    def receive(name):
        line = workers[name].stdout.readline()
        if not line:
            code = workers[name].wait()
            raise SystemExit(f"train: the {name} run failed (exit {code})")
        return json.loads(line)

    try:
        for step in range(1, args.steps + 1):
            records = {}
            for name, proc in workers.items():
                proc.stdin.write("\n")
                proc.stdin.flush()
                records[name] = receive(name)
            _progress(step, args.steps, records)
        return {name: receive(name) for name in workers}
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait()


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _report(runs: dict, args) -> bool:
    fa_run, sd_run = runs["flashattn"], runs["sdpa"]
    steps = len(fa_run["losses"])
    print(f"\nchar-level transformer: {args.layers} layers, d_model {args.d_model}, "
          f"{args.heads} heads, T = {args.seq}, batch {args.batch}, "
          f"{fa_run['parameters']:,} parameters; torch {fa_run['torch']}, "
          f"{fa_run['threads']} threads, device {args.device}, "
          f"{'bfloat16 (autocast)' if args.dtype == 'bf16' else 'float32'}")
    print(f"\n{'step':>6} {'flashattn':>10} {'sdpa':>10} {'rel. diff':>10}")
    marks = sorted({1, steps, *range(0, steps + 1, max(1, steps // 10))} - {0})
    for s in marks:
        a, b = fa_run["losses"][s - 1], sd_run["losses"][s - 1]
        print(f"{s:>6} {a:>10.4f} {b:>10.4f} {abs(a - b) / abs(b):>10.2e}")
    print(f"\n{'':<26} {'flashattn':>10} {'sdpa':>10}")
    # The first step builds caches and warms up allocators: left out.
    med = [1e3 * _median(r["step_seconds"][1:] or r["step_seconds"]) for r in (fa_run, sd_run)]
    print(f"{'step time, median (ms)':<26} {med[0]:>10.1f} {med[1]:>10.1f}")
    print(f"{'attention calls (forward)':<26} {fa_run['attention_calls']:>10} "
          f"{sd_run['attention_calls']:>10}")
    print(f"{'attention inputs':<26} {fa_run['attention_dtype']:>10} "
          f"{sd_run['attention_dtype']:>10}")
    print(f"{'peak RSS (MiB)':<26} {fa_run['rss_peak_mib']:>10.0f} {sd_run['rss_peak_mib']:>10.0f}")
    growth = [r["rss_peak_mib"] - r["rss_before_mib"] for r in (fa_run, sd_run)]
    print(f"{'  of it while training':<26} {growth[0]:>10.0f} {growth[1]:>10.0f}")
    if hasattr(os, "getloadavg"):
        print("machine load (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    a, b = fa_run["losses"][-1], sd_run["losses"][-1]
    rel = abs(a - b) / abs(b)
    agree = rel <= AGREEMENT[args.dtype]
    print(f"\nfinal loss: flashattn {a:.6f}, sdpa {b:.6f}; relative difference {rel:.2e} "
          f"({'within' if agree else 'OUTSIDE'} {AGREEMENT[args.dtype]:g})")
    return agree


def _plot(runs: dict, path: str, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("flashattn", "-"), ("sdpa", "--")):
        losses = runs[name]["losses"]
        ax.plot(range(1, len(losses) + 1), losses, style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats)")
    ax.set_title("char-level transformer: flashattn vs torch SDPA, same seed, "
                 f"{'bfloat16' if dtype == 'bf16' else 'float32'}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curves drawn to {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    _check(args)
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        print("train: needs torch: pip install 'flashattn[torch]'", file=sys.stderr)
        return 2
    runs = _run_interleaved(args)
    agree = _report(runs, args)
    if args.plot:
        _plot(runs, args.plot, args.dtype)
    return 0 if agree and all(math.isfinite(r["losses"][-1]) for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
