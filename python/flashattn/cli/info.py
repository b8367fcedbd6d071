"""`python -m flashattn info`: what this installation is and what it runs on
-- versions, platform, engines, and the cpu engine's instruction-set path
(the one in use, the ones this CPU supports, the ones built in)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashattn info", description=__doc__)
    parser.parse_args(argv)

    import numpy as np

    import flashattn as fa

    forced = os.environ.get("FLASHATTN_CPU_ISA")
    print(f"flashattn {fa.__version__} at {os.path.dirname(fa.__file__)}")
    print(f"python {platform.python_version()}, numpy {np.__version__}, "
          f"{platform.system()} {platform.machine()}")
    print(f"engines, best first: {', '.join(fa.backends())}")
    print(f"cpu engine threads: {fa.get_num_threads()}")
    try:
        isa = fa.cpu_isa()
    except (ValueError, RuntimeError) as e:  # a bad FLASHATTN_CPU_ISA
        print(f"cpu instruction set in use: none: {e}")
        return 1
    print(f"cpu instruction set in use: {isa}"
          + (f" (forced by FLASHATTN_CPU_ISA={forced})" if forced else " (the best supported)"))
    print(f"cpu instruction sets this CPU runs: {', '.join(fa.cpu_isas())}")
    print(f"cpu instruction sets built in: {', '.join(fa.cpu_isas(compiled=True))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
