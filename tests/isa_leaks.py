"""Checks a built x86-64 binary (the extension module or a test program):
every AVX or AVX-512 instruction in it lies in a function of the cpu
engine's matching per-ISA namespace (flashattn::cpu::avx2::, ::avx512::),
and the avx2 copy has no AVX-512 instruction. Anything else -- an inline
function shared with other translation units but emitted with wide
instructions, a std:: template, a helper outside the target region -- could
run on a CPU without those instructions and die of SIGILL. Reads
`objdump -d -C` output; exit status 1 lists the offending functions.

usage: python tests/isa_leaks.py BINARY...
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict

FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
# VEX/EVEX-encoded instructions all have a mnemonic starting with v (AVX,
# AVX2, FMA, AVX-512); AVX-512 also by its zmm and mask registers.
AVX = re.compile(r"^\s*[0-9a-f]+:\s+v[a-z0-9]+\s")
AVX512 = re.compile(r"%zmm|%k[0-7]\b|\{%k|\{1to")


def scan(path: str) -> list[str]:
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", path],
                             capture_output=True, text=True, check=True).stdout
    avx, avx512 = defaultdict(int), defaultdict(int)
    name = ""
    for line in listing.splitlines():
        m = FUNCTION.match(line)
        if m:
            name = m.group(1)
        elif AVX.match(line):
            avx[name] += 1
            if AVX512.search(line):
                avx512[name] += 1
    problems = []
    for fn, n in sorted(avx.items()):
        if "flashattn::cpu::avx512::" in fn:
            continue
        if "flashattn::cpu::avx2::" in fn and fn not in avx512:
            continue
        problems.append(f"{path}: {n} AVX instruction(s) ({avx512.get(fn, 0)} AVX-512) in {fn}")
    counts = {ns: sum(n for fn, n in avx.items() if f"flashattn::cpu::{ns}::" in fn)
              for ns in ("avx512", "avx2")}
    print(f"{path}: AVX instructions: {counts['avx512']} in avx512::, {counts['avx2']} in "
          f"avx2::, {sum(avx.values()) - sum(counts.values())} elsewhere")
    return problems


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    problems = [p for path in paths for p in scan(path)]
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
