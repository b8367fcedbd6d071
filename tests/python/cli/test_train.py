"""`python -m flashattn train` (and examples/train_gpt.py), in a short
version: both runs (flashattn and torch SDPA, same seed) finish, their loss
curves are printed side by side and agree, step time and peak memory are
reported, and --plot writes a PNG."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the training example needs torch: pip install '.[torch]'")

ROOT = Path(__file__).resolve().parents[3]
SHORT = ["--steps", "12", "--seq", "64", "--layers", "2", "--d-model", "64", "--batch", "4"]


def _run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_short_training_run_compares_both_attentions():
    out = _run([sys.executable, "-m", "flashattn", "train", *SHORT])
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", text, re.M)
    assert rows and int(rows[0][0]) == 1 and int(rows[-1][0]) == 12, text
    final = re.search(r"final loss: flashattn ([\d.]+), sdpa ([\d.]+); relative difference "
                      r"([\d.e+-]+) \(within 0.001\)", text)
    assert final, text
    assert abs(float(final[1]) - float(final[2])) <= 1e-3 * float(final[2])
    assert float(final[1]) < float(rows[0][1])  # it learned something
    assert re.search(r"step time, median \(ms\)\s+[\d.]+\s+[\d.]+", text), text
    assert re.search(r"peak RSS \(MiB\)\s+\d+\s+\d+", text), text
    assert re.search(r"attention calls \(forward\)\s+24\s+24", text), text  # 2 layers x 12
    assert re.search(r"attention inputs\s+float32\s+float32", text), text
    assert "12/12" in out.stderr  # the progress bar reached the end


def test_bfloat16_training_runs_both_attentions_in_bfloat16():
    out = _run([sys.executable, "-m", "flashattn", "train", *SHORT, "--dtype", "bf16"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bfloat16 (autocast)" in out.stdout
    final = re.search(r"final loss: flashattn ([\d.]+), sdpa ([\d.]+); relative difference "
                      r"([\d.e+-]+) \(within 0.02\)", out.stdout)
    assert final, out.stdout
    assert re.search(r"attention calls \(forward\)\s+24\s+24", out.stdout), out.stdout
    assert re.search(r"attention inputs\s+bfloat16\s+bfloat16", out.stdout), out.stdout


def test_plot_writes_both_loss_curves_to_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib: pip install '.[bench]'")
    png = tmp_path / "losses.png"
    out = _run([sys.executable, "-m", "flashattn", "train", "--steps", "3", "--seq", "16",
                "--layers", "1", "--d-model", "16", "--plot", str(png)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_example_script_is_the_same_command():
    out = _run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--help"])
    assert out.returncode == 0, out.stderr
    assert "flashattn's attention" in out.stdout and "--plot" in out.stdout


def test_bad_arguments_are_reported():
    out = _run([sys.executable, "-m", "flashattn", "train", "--d-model", "30", "--heads", "4"])
    assert out.returncode != 0
    assert "--d-model (30) must be a multiple of --heads (4)" in out.stderr
