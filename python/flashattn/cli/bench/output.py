"""What the benchmarks print, and what ``--json FILE`` writes: a progress
line on stderr while they run, then a header naming the machine and the
settings, and tables. A Table prints as aligned text and is kept as rows of
numbers, so the text and the JSON hold the same figures (the JSON also each
run's time)."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .. import machine


class Progress:
    """One status line on stderr. On a terminal it is rewritten in place,
    with a note per timed run; into a file or a pipe (a log) it is one line
    per case, and the runs' notes are left out."""

    def __init__(self, total, stream=None):
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def step(self, what):
        self.done += 1
        line = f"[{self.done}/{self.total}] {what}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, what):
        if self.tty:
            self.stream.write(f"\r\033[K[{self.done}/{self.total}] {what}")
            self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


class Column:
    """key: the row's field; header; fmt: a format spec for numbers ('.2f',
    'd', 'x' for a ratio shown as 1.23x, '%' for a share shown as 45.6%)."""

    def __init__(self, key: str, header: str, fmt: str = "s"):
        self.key, self.header, self.fmt = key, header, fmt

    def cell(self, value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if self.fmt == "x":
            return f"{value:.2f}x"
        if self.fmt == "%":
            return f"{100 * value:.1f}%"
        if self.fmt == "s":
            return str(value)
        return format(value, self.fmt)


class Table:
    """Rows of named figures, printed as a text table with a title and
    notes under it; ``as_json`` gives the same figures. Row fields that are
    not columns (each run's time, say) go into the JSON only."""

    def __init__(self, name: str, title: str, columns: Sequence[Column]):
        self.name, self.title, self.columns = name, title, list(columns)
        self.rows: List[Dict[str, Any]] = []
        self.notes: List[Dict[str, Any]] = []

    def add(self, row: Dict[str, Any]):
        self.rows.append(row)

    def note(self, text: str, **figures):
        """A line under the table (a summary), with its figures for the JSON."""
        self.notes.append(dict(figures, text=text))

    def render(self) -> str:
        cells = [[c.cell(row.get(c.key)) for c in self.columns] for row in self.rows]
        widths = [max([len(c.header)] + [len(r[i]) for r in cells])
                  for i, c in enumerate(self.columns)]
        left = [c.fmt == "s" for c in self.columns]  # text left, numbers right

        def line(items):
            return "  ".join(item.ljust(w) if lft else item.rjust(w)
                             for item, w, lft in zip(items, widths, left)).rstrip()

        head = line([c.header for c in self.columns])
        out = ["", self.title, head, "-" * len(head)]
        out += [line(r) for r in cells]
        out += [n["text"] for n in self.notes]
        return "\n".join(out)

    def print(self, out=None):
        print(self.render(), file=out or sys.stdout)

    def as_json(self) -> dict:
        return {"name": self.name, "title": self.title,
                "columns": [{"key": c.key, "header": c.header} for c in self.columns],
                "rows": self.rows, "notes": self.notes}


def ms_runs(times: Sequence[float]) -> List[float]:
    """Each run's time in ms, for the JSON."""
    return [round(t * 1e3, 6) for t in times]


def threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


class Report:
    """The header (machine, versions, settings) and the tables of one bench
    run: printed in that order, and written to ``--json FILE``."""

    def __init__(self, command: str, settings: Dict[str, Any]):
        import flashattn as fa

        self.command = command
        self.machine = machine.describe()
        self.settings = dict(settings)
        self.lines: List[str] = []
        self.load_at_start = os.getloadavg()[0]
        self.fa = fa
        self.tables: List[Table] = []
        self.figures: Dict[str, Any] = {}

    def line(self, text: str, **figures):
        """A header line, with the figures it states for the JSON."""
        self.lines.append(text)
        self.figures.update(figures)

    def header(self) -> str:
        fa = self.fa
        try:
            isa = fa.cpu_isa()
        except (ValueError, RuntimeError) as e:  # a bad FLASHATTN_CPU_ISA
            isa = f"none ({e})"
        first = [f"flashattn {fa.__version__}, {self.command}",
                 machine.summary(self.machine),
                 f"cpu engine path: {isa} (this CPU runs: {', '.join(fa.cpu_isas())}); "
                 f"load average at start {self.load_at_start:.2f}"]
        return "\n".join(first + self.lines)

    def add(self, table: Table) -> Table:
        self.tables.append(table)
        return table

    def print(self, out=None):
        out = out or sys.stdout
        print(self.header(), file=out)
        for table in self.tables:
            table.print(out)
        print(f"\nload average at end {os.getloadavg()[0]:.2f}", file=out)

    def write_json(self, path: Optional[str]):
        if not path:
            return
        fa = self.fa
        doc = {"flashattn": fa.__version__, "command": self.command,
               "machine": self.machine,
               "cpu_isa": fa.cpu_isa(), "cpu_isas": fa.cpu_isas(),
               "load_average": {"start": self.load_at_start, "end": os.getloadavg()[0]},
               "settings": self.settings, "figures": self.figures,
               "tables": [t.as_json() for t in self.tables]}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_plain(doc), f, indent=1, allow_nan=False)
            f.write("\n")


def _plain(x):
    """x with NumPy scalars made Python numbers, tuples lists, and NaN or
    inf None (JSON has neither)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
