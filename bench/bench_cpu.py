"""The cpu engine against PyTorch's scaled_dot_product_attention (CPU).

Same as `python -m flashattn bench`; run from anywhere once flashattn is
installed, with torch (and matplotlib for --plot) from the bench extra:

    pip install '.[bench]'
    python bench/bench_cpu.py [--threads N] [--repeat N] [--plot FILE.png] [--skip ...]
"""

import sys

from flashattn.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
