"""The command line: `python -m flashattn --help` lists the subcommands,
bad arguments are usage errors at once (exit status 2, naming the option),
`info` shows the cpu engine's path, the report ends with one verdict line
and exits 1 when a check fails, and a failing timing child is an error
rather than a parent waiting forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import flashattn as fa
from flashattn import __main__ as cli
from flashattn.cli import report as _report


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "flashattn", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_the_subcommands():
    r = run_cli("--help")
    assert r.returncode == 0
    for name in ("report", "bench", "info"):
        assert name in r.stdout
    assert "(the default)" in r.stdout


@pytest.mark.parametrize("args, option", [
    (["--repeats", "0"], "--repeats"),
    (["--seq", "-5"], "--seq"),
    (["report", "--seq", "x"], "--seq"),
    (["bench", "--repeat", "0"], "--repeat"),
    (["bench", "--threads", "0"], "--threads"),
])
def test_bad_arguments_are_usage_errors_not_hangs(args, option):
    r = run_cli(*args, timeout=60)  # a hang fails here with TimeoutExpired
    assert r.returncode == 2, r.stdout + r.stderr
    assert option in r.stderr and "positive integer" in r.stderr


def test_an_unknown_subcommand_is_a_usage_error():
    r = run_cli("benchmark")
    assert r.returncode == 2 and "unknown subcommand 'benchmark'" in r.stderr


def test_info_shows_the_cpu_path_in_use():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert f"cpu instruction set in use: {fa.cpu_isa()}" in r.stdout
    assert f"engines, best first: {', '.join(fa.backends())}" in r.stdout


def test_a_timing_child_that_fails_is_an_error_not_a_hang():
    # An engine name the child rejects: it raises before putting a result.
    code = ("from flashattn.cli import report as _report\n"
            "try:\n    _report.timed('no-such-engine', (1, 8, 8, 1, 1, 8), True, 1)\n"
            "except RuntimeError as e:\n    print('RuntimeError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RuntimeError: timing no-such-engine" in r.stdout, r.stdout + r.stderr


def fake_timed(engine, shape, causal, repeats):
    return 0.001, 0.003, 1 << 20


def test_the_report_ends_with_a_pass_verdict(monkeypatch, capsys):
    monkeypatch.setattr(_report, "timed", fake_timed)  # correctness for real, no timing
    assert cli.main(["--seq", "64", "--repeats", "1"]) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("verdict: PASS")


def test_a_failed_correctness_check_gives_a_fail_verdict_and_status_1(monkeypatch, capsys):
    monkeypatch.setattr(_report, "timed", fake_timed)
    monkeypatch.setattr(_report, "check", lambda *a: (1.0, 50.0, 1.0))  # o 50x numpy's error
    assert cli.main(["report", "--seq", "64", "--repeats", "1"]) == 1
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1].startswith("verdict: FAIL")
    assert sum(line.startswith("verdict:") for line in out) == 1


def test_the_console_script_is_installed():
    exe = shutil.which("flashattn", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip(f"no flashattn script beside {sys.executable} (not a pip-installed venv)")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "bench" in r.stdout
