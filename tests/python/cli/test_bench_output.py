"""What `python -m flashattn bench` shows a user (issue 31): a header naming
the machine (CPU model, cores, instruction-set extensions), tables of
times, ratios and shares of the peak with no project goals or verdicts in
them, a progress line rewritten in place on a terminal but one line per
case in a log, and ``--json FILE`` holding every figure the text shows.
The sections run here on tiny shapes (times are not checked)."""

from __future__ import annotations

import io
import json
import os
import re

import pytest

from flashattn.cli import machine
from flashattn.cli.bench import cpu, limits, options
from flashattn.cli.bench.output import Column, Progress, Table

VERDICTS = re.compile(r"\bgoal|\btarget|NOT met|\bmet\b", re.I)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_into_a_log_is_one_line_per_case():
    log = io.StringIO()
    progress = Progress(2, stream=log)
    progress.step("case one")
    for r in range(5):
        progress.note(f"case one: run {r + 1}/5")
    progress.step("case two")
    progress.close()
    assert log.getvalue() == "[1/2] case one\n[2/2] case two\n"


def test_progress_on_a_terminal_is_rewritten_in_place():
    tty = _Terminal()
    progress = Progress(1, stream=tty)
    progress.step("case")
    progress.note("case: run 1/5")
    progress.close()
    text = tty.getvalue()
    assert "\n" not in text and text.count("\r\033[K") == 3 and "run 1/5" in text


def test_a_table_prints_what_it_keeps():
    table = Table("t", "title", [Column("name", "name"), Column("ms", "ms", ".2f"),
                                 Column("ratio", "ratio", "x"), Column("share", "share", "%")])
    table.add({"name": "a", "ms": 1.234, "ratio": 2.0, "share": 0.5, "runs_ms": [1.3, 1.234]})
    table.add({"name": "b", "ms": 10.0, "ratio": None, "share": 0.125})
    table.note("a summary", lowest=0.125)
    lines = table.render().splitlines()
    assert lines[1:3] == ["title", "name     ms  ratio  share"]
    assert lines[4:] == ["a      1.23  2.00x  50.0%", "b     10.00      -  12.5%", "a summary"]
    doc = table.as_json()
    assert doc["rows"][0]["runs_ms"] == [1.3, 1.234] and doc["notes"] == [
        {"text": "a summary", "lowest": 0.125}]


def test_the_machine_is_described():
    info = machine.describe()
    assert info["logical_cores"] == os.cpu_count() and info["usable_cores"] >= 1
    line = machine.summary(info)
    assert line.startswith("CPU: ") and f"{info['logical_cores']} logical cores" in line
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            text = f.read()
        model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        if model:
            assert info["model"] == model[1].strip() and model[1].strip() in line
        if re.search(r"^flags\s*:.*\bavx2\b", text, re.M):
            assert "avx2" in info["flags"] and "avx2" in line


def _tiny(monkeypatch):
    """Every section that takes its cases from a list, on tiny cases."""
    monkeypatch.setattr(cpu, "SHAPES", [(1, 64, 2, 1, 16, True), (1, 48, 2, 2, 8, False)])
    monkeypatch.setattr(limits, "DECODE", [("fp32", 1, 256, 1), ("bf16", 2, 200, 4)])
    monkeypatch.setattr(limits, "LONG_TS", [64, 96])
    monkeypatch.setattr(limits, "SMALL", [(1, 32, 8)])
    monkeypatch.setattr(limits, "CASES", {"decode": limits.DECODE, "long-t": limits.LONG_TS,
                                          "gqa-bwd": limits.GQA_CASES, "small": limits.SMALL})


def test_the_cpu_bench_text_and_json(monkeypatch, capsys, tmp_path):
    _tiny(monkeypatch)
    out_json = tmp_path / "bench.json"
    assert cpu.main(["--only", "table,decode,long-t,small", "--threads", "1", "--repeat", "5",
                     "--json", str(out_json)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert not VERDICTS.search(text), VERDICTS.search(text)
    head = text.splitlines()[:3]
    assert head[1].startswith("CPU: ") and "logical cores" in head[1] and "extensions:" in head[1]
    assert "cpu engine path:" in head[2]
    # In a log (pytest captures stderr), one progress line per case, none per run.
    assert captured.err.count("\n") == 2 + 2 + 2 + 1 and "run 1/" not in captured.err

    doc = json.loads(out_json.read_text())
    assert doc["machine"] == machine.describe()
    assert doc["settings"]["threads"] == 1 and doc["settings"]["repeat"] == 5
    assert doc["figures"]["fma_peak_gflops"] > 0
    assert [t["name"] for t in doc["tables"]] == ["table", "decode", "long-t", "small"]
    tables = {t["name"]: t for t in doc["tables"]}
    assert len(tables["table"]["rows"]) == 4 and len(tables["decode"]["rows"]) == 2
    for table in doc["tables"]:
        assert table["title"] in text
        for note in table["notes"]:
            assert note["text"] in text
        for row in table["rows"]:
            for column in table["columns"]:
                cell = Column(column["key"], column["header"],
                              _fmt(tables, table["name"], column["key"])).cell(row.get(column["key"]))
                assert cell in text, (table["name"], column["key"], cell)
    first = tables["table"]["rows"][0]
    assert len(first["ours_runs_ms"]) == 5 and min(first["ours_runs_ms"]) == pytest.approx(
        first["ours_ms"], rel=1e-6)


def _fmt(tables, name, key):
    """The format the text gives a column, spelled out here rather than
    taken from the bench's own Column objects."""
    if key in ("shape", "pass", "dtype", "mask", "option", "batch"):
        return "s"
    if key in ("B", "T", "Tk", "Tq", "D", "work"):
        return "d"
    if key in ("speedup", "vs_first", "vs_fp32", "vs_skewed", "cpu_vs_metal", "mlx_vs_metal"):
        return "x"
    if key.endswith("peak") or key == "share":
        return "%"
    if key.endswith("gflops") or key.endswith("gbs"):
        return ".1f"
    if name == "small" and key.endswith("_ms"):
        return ".3f"
    return ".2f"


def test_the_options_bench_text_and_json(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(options, "OPTIONS_SHAPE", (1, 40, 2, 1, 16))
    monkeypatch.setattr(options, "VARLEN_LENGTHS", [30, 7, 1])
    monkeypatch.setattr(options, "SHORT_BATCH", (3, 8))
    monkeypatch.setattr(options, "MIXED_BATCH", (4, 16))
    out_json = tmp_path / "options.json"
    assert options.main(["--threads", "1", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert not VERDICTS.search(text)
    doc = json.loads(out_json.read_text())
    tables = {t["name"]: t for t in doc["tables"]}
    assert len(tables["options"]["rows"]) == 12 and len(tables["varlen"]["rows"]) == 3
    plain = [r for r in tables["options"]["rows"] if r["option"] == "plain"]
    assert all(r["cost"] == 0 for r in plain) and "+0.0%" in text
    assert tables["varlen"]["rows"][0]["work"] == 30 * 30 + 7 * 7 + 1
    assert len(tables["one-launch"]["rows"]) == 4 and "one call ms" in text


def test_json_needs_a_file_name():
    with pytest.raises(SystemExit):
        cpu.main(["--json"])
