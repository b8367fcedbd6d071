"""`python -m flashattn info`: what this installation is and what it runs on
-- versions, platform, the CPU (model, cores, extensions), engines (and why
any is left out: not built here, did not start, or failed its self-test),
the GPU engines' self-test so far, and the cpu engine's instruction-set
path (the one in use, the ones this CPU
supports, the ones built in)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import List, Optional

from . import machine


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashattn info", description=__doc__)
    parser.parse_args(argv)

    import numpy as np

    import flashattn as fa

    forced = os.environ.get("FLASHATTN_CPU_ISA")
    print(f"flashattn {fa.__version__} at {os.path.dirname(fa.__file__)}")
    print(f"python {platform.python_version()}, numpy {np.__version__}, "
          f"{platform.system()} {platform.machine()}")
    print(machine.summary(machine.describe()))
    from .. import _core, _engines

    print(f"engines, best first: {', '.join(fa.backends())}")
    for name, (reason, _failed) in _engines.missing().items():
        print(f"engine left out: {name}: {reason}")
    for name in fa.backends():
        stats = _core._selftest_stats(name)
        if stats is not None:
            print(f"{name} self-test: {stats['pipelines']} pipelines passed in {stats['probes']} "
                  f"known-answer calls, {stats['seconds']:.3f} s so far "
                  f"(FLASHATTN_METAL_SELFTEST=0 turns it off)")
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
