"""Prints why each skipped ctest test was skipped: ctest lists a skipped
test (SKIP_RETURN_CODE 77) without its output, so this reads the JUnit
file `ctest --output-junit FILE` wrote and prints each skipped test's name
with the last line it printed (its reason: no AVX-512 on this CPU, no
clang-19 found, ...). Called by tests/run.sh and tests/sanitize.sh.

usage: python tests/ctest_skips.py JUNIT.xml"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def skipped(path: str):
    """(name, reason) of every skipped test in the JUnit file."""
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.get("status") not in ("notrun", "skipped") and case.find("skipped") is None:
            continue
        out = case.findtext("system-out") or ""
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        yield case.get("name"), lines[-1] if lines else "(it printed no reason)"


def main(argv) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    for name, reason in skipped(argv[0]):
        print(f"skipped {name}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
