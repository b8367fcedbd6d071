"""Train a small character-level transformer (4 layers, T = 256) in PyTorch,
once with flashattn's attention and once with torch SDPA, from the same seed,
and compare the loss curves, step times and peak memory.

    pip install ".[torch]"            # and matplotlib for --plot
    python examples/train_gpt.py --plot losses.png
    python examples/train_gpt.py --steps 20 --seq 64   # a quick look
    python examples/train_gpt.py --dtype bf16          # both in bfloat16 (autocast)

The same as `python -m flashattn train`. The model and the loop are in
flashattn/cli/train.py; the one line that matters is the attention call:

    import flashattn.torch as fat
    y = fat.attention(q, k, v, causal=True, layout="bhtd")   # (B, H, T, D)

in place of torch.nn.functional.scaled_dot_product_attention(q, k, v,
is_causal=True); autograd runs flashattn's fused backward.
"""

import sys

from flashattn.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
