"""The README's code blocks, for the tests that run them as written
(test_readme.py; distributed/test_distributed.py runs the ring one under
mpiexec). Not a test module."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def python_blocks() -> list:
    """Every ```python block of the README, in order."""
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)


def block_with(text: str) -> str:
    """The one ```python block containing ``text``."""
    found = [b for b in python_blocks() if text in b]
    assert len(found) == 1, f"{len(found)} README python blocks contain {text!r}"
    return found[0]
