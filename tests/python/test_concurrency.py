"""Determinism and threads: the same inputs give bit-identical outputs,
forward and backward, whatever the cpu engine's thread count; eight Python
threads calling at once get exactly the sequential results; the GIL is
released while an engine computes."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

import flashattn as fa
from helpers import SIMULATED, Case, inputs

CASES = [
    Case(2, 77, 130, 6, 2, 59, causal=True),
    Case(1, 130, 77, 4, 1, 64, window=(20, 7)),     # Tq > Tk: masked rows
    Case(3, 1, 150, 4, 4, 111),                     # decode
    Case(1, 96, 96, 2, 2, 256, causal=True, window=(31, 0)),
]


def run(backend, case, seed=0):
    """o, lse, dq, dk, dv of one call."""
    q, k, v, do = inputs(case, seed=seed)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend, **case.opts())
    grads = fa.attention_backward(do, q, k, v, o, lse, backend=backend, **case.opts())
    return (o, lse, *grads)


def assert_bit_identical(a, b, what):
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), a, b):
        assert x.tobytes() == y.tobytes(), f"{what}: {name} differs"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_same_inputs_give_bit_identical_outputs(backend, case):
    first = run(backend, case)
    for _ in range(2):
        assert_bit_identical(first, run(backend, case), "a repeated call")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_thread_count_does_not_change_results(backend, case, restore_threads):
    fa.set_num_threads(1)
    want = run(backend, case)
    for n in (2, 3, 7):
        fa.set_num_threads(n)
        assert fa.get_num_threads() == n
        assert_bit_identical(want, run(backend, case), f"{n} threads vs 1")


# Half inputs on the cpu engine: a task carries up to four query tiles of a
# kv head through the key blocks together, fewer as the threads grow (1
# thread: 4, 2: 2, 3 and 7: 1 in the GQA case), runs of one kv head and one
# first key (the window case's tiles start at different keys; some tasks
# cross from one kv head to the next). What a tile computes must not change.
HALF_CASES = [
    Case(1, 300, 300, 4, 2, 64, causal=True),
    Case(1, 200, 260, 4, 4, 40, window=(70, 10)),
    Case(2, 130, 130, 2, 1, 128),
]


@pytest.mark.parametrize("half", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("case", HALF_CASES, ids=lambda c: c.id)
def test_thread_count_does_not_change_half_precision_results(half, case, restore_threads):
    q, k, v, _ = inputs(case, dtype=half)
    fa.set_num_threads(1)
    want = fa.attention(q, k, v, return_lse=True, backend="cpu", **case.opts())
    for n in (2, 3, 7):
        fa.set_num_threads(n)
        got = fa.attention(q, k, v, return_lse=True, backend="cpu", **case.opts())
        for name, x, y in zip(("o", "lse"), want, got):
            assert x.tobytes() == y.tobytes(), f"{n} threads vs 1: {name} differs"


def test_concurrent_calls_match_sequential(backend):
    """8 Python threads, each running forward and backward on its own case
    and seed, twice, all released at once; then the same calls one by one."""
    cases = CASES if backend not in SIMULATED else [
        Case(2, 37, 50, 6, 2, 59, causal=True), Case(1, 50, 37, 4, 1, 64, window=(20, 7)),
        Case(3, 1, 70, 4, 4, 111), Case(1, 40, 40, 2, 2, 256, causal=True, window=(15, 0))]
    jobs = [(cases[t % len(cases)], t // len(cases)) for t in range(8)]
    want = [run(backend, case, seed) for case, seed in jobs]

    results = [[None, None] for _ in jobs]
    errors = []
    barrier = threading.Barrier(len(jobs))

    def worker(t):
        try:
            barrier.wait()
            for r in range(2):
                results[t][r] = run(backend, *jobs[t])
        except BaseException as e:  # reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for t, (case, seed) in enumerate(jobs):
        for r in range(2):
            assert_bit_identical(want[t], results[t][r], f"thread {t} ({case.id}) round {r}")


def _main_thread_ticks_inside(call):
    """Runs call() in a thread while this thread spins on time.perf_counter();
    returns how many of its ticks fall in the middle half of the call, and
    the call's duration. A call that holds the GIL gets none: this thread
    cannot run a bytecode until the call returns."""
    span = {}
    done = threading.Event()

    def work():
        span["start"] = time.perf_counter()
        call()
        span["end"] = time.perf_counter()
        done.set()

    stamps = []
    th = threading.Thread(target=work)
    th.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
    th.join()
    d = span["end"] - span["start"]
    lo, hi = span["start"] + 0.25 * d, span["end"] - 0.25 * d
    return sum(lo < t < hi for t in stamps), d


def test_gil_is_released_during_compute(backend, restore_threads):
    fa.set_num_threads(1)  # leave a core for this thread
    case = (Case(1, 1024, 1024, 4, 4, 64) if backend not in SIMULATED
            else Case(1, 256, 256, 2, 2, 64))
    q, k, v, do = inputs(case)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend)
    ticks, d = _main_thread_ticks_inside(lambda: fa.attention(q, k, v, backend=backend))
    assert ticks > 0, f"forward ({d * 1e3:.0f} ms) held the GIL"
    ticks, d = _main_thread_ticks_inside(
        lambda: fa.attention_backward(do, q, k, v, o, lse, backend=backend))
    assert ticks > 0, f"backward ({d * 1e3:.0f} ms) held the GIL"
    # The measurement sees a call that holds the GIL: sum() over a range
    # runs in C without releasing it.
    ticks, d = _main_thread_ticks_inside(lambda: sum(range(10**7)))
    assert ticks == 0
