"""`python -m flashattn bench`'s competitor: torch is started with its OpenMP
threads sleeping when idle, unless the environment chose a policy, so that
their spinning after a call does not take the cores from the next contender
timed on them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

PROBE = (
    "import os; from flashattn.cli.bench.cpu import import_torch; "
    "torch, note = import_torch(1); print(os.environ['OMP_WAIT_POLICY']); print(note)"
)


def _probe(env):
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    return out.stdout.splitlines()


def test_torch_threads_sleep_when_idle_by_default():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    policy, note = _probe(env)
    assert policy == "PASSIVE"
    assert note.endswith("scaled_dot_product_attention (OMP_WAIT_POLICY=PASSIVE)")


def test_a_policy_from_the_environment_is_kept():
    policy, note = _probe(dict(os.environ, OMP_WAIT_POLICY="ACTIVE"))
    assert policy == "ACTIVE"
    assert note.endswith("(OMP_WAIT_POLICY=ACTIVE)")
