"""`python -m flashattn bench --backend metal`: without the metal engine it
says it cannot run (and exits 2), and with MLX still runs the in-stream
training-step section on metal-sim, saying so; its timing tables work,
shown here with metal-sim standing in for the GPU engine on a tiny shape
(and MLX's CPU build as the competitor when it is installed). Times are
not checked."""

from __future__ import annotations

import io

import pytest

import flashattn as fa
from flashattn.cli.bench import metal as _bench_metal


@pytest.mark.skipif("metal" in fa.backends(), reason="this machine has the metal engine")
def test_says_it_cannot_run_without_metal(capsys):
    assert _bench_metal.main(["--backend", "metal", "--sim-seqs", "16"]) == 2
    out, err = capsys.readouterr()
    assert "cannot run the Metal benchmark" in err and "metal engine is not available" in err
    try:
        import mlx.core  # noqa: F401
    except ImportError:
        return
    assert "metal-sim standing in for the GPU" in out and "T = 1k-16k needs a Mac" in out
    row = next(line for line in out.splitlines() if line.startswith("| 16 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 8 and cells[5].endswith("x")  # both attentions ran
    assert float(cells[7]) < 1e-4  # the same model learns the same: losses agree


def test_bad_repeat_is_an_error():
    with pytest.raises(SystemExit):
        _bench_metal.main(["--backend", "metal", "--repeat", "2"])


@pytest.mark.parametrize("with_mlx", [False, True], ids=["engines-only", "mlx"])
def test_table_has_every_engine_and_ratio(with_mlx):
    mx = pytest.importorskip("mlx.core") if with_mlx else None
    shape = (1, 9, 20, 4, 2, 16, True)
    rows = _bench_metal.run([shape], 5, gpu="metal-sim", cpu="cpu", mx=mx)
    (label, flops, times), = rows
    names = {"metal fwd", "metal fwd+bwd", "cpu fwd", "cpu fwd+bwd"}
    if with_mlx:
        names |= {"mlx fwd", "mlx fwd+bwd"}
    assert set(times) == names and all(len(t) == 5 for t in times.values())
    out = io.StringIO()
    _bench_metal.print_table(rows, with_mlx, out=out)
    text = out.getvalue()
    assert "cpu/metal" in text and ("mlx/metal" in text) == with_mlx
    assert text.count(label) == 2  # fwd and fwd+bwd
