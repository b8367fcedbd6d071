"""The main job, `python -m flashattn`: which engines this machine has, is
each one right (against the float64 reference), and what does it cost in time
and memory next to the plain NumPy implementation."""

from __future__ import annotations

import argparse
import multiprocessing
import queue as queue_module
import resource
import sys
import time

import numpy as np

from .. import _api, _engines, reference
from .args import positive_int

# The engine that simulates GPU kernels on the CPU is for tests: far too slow
# for the timed shape, so it is only checked for correctness.
_SIMULATED = {"metal-sim"}


def _inputs(B, Tq, Tk, H, Hkv, D, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    k = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
    do = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    return q, k, v, do


def _max_err(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want))) if want.size else 0.0


def check(engine, shape, causal, window):
    """Max error of the engine's o, dq, dk, dv against float64, as a ratio to
    the plain float32 implementation's error (FlashAttention's test rule)."""
    q, k, v, do = _inputs(*shape)
    opts = dict(causal=causal, window=window)
    o64 = reference.attention(q, k, v, **opts)
    g64 = reference.attention_backward(do, q, k, v, **opts)
    o32 = reference.attention(q, k, v, dtype=np.float32, **opts)
    g32 = reference.attention_backward(do, q, k, v, dtype=np.float32, **opts)
    o, lse = _api.attention(q, k, v, return_lse=True, backend=engine, **opts)
    grads = _api.attention_backward(do, q, k, v, o, lse, backend=engine, **opts)
    ratios = [_max_err(got, want) / max(_max_err(base, want), 1e-7)
              for got, base, want in zip((o, *grads), (o32, *g32), (o64, *g64))]
    return _max_err(o, o64), ratios[0], max(ratios[1:])


def _timed_run(engine, shape, causal, repeats, queue):
    """In a fresh process: best forward and forward+backward times, and the
    peak resident memory beyond the inputs."""
    q, k, v, do = _inputs(*shape)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fwd, total = [], []
    for _ in range(repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        if engine == "numpy":
            reference.attention(q, k, v, causal=causal, dtype=np.float32)
            t1 = time.perf_counter()
            reference.attention_backward(do, q, k, v, causal=causal, dtype=np.float32)
        else:
            o, lse = _api.attention(q, k, v, causal=causal, return_lse=True, backend=engine)
            t1 = time.perf_counter()
            _api.attention_backward(do, q, k, v, o, lse, causal=causal, backend=engine)
        total.append(time.perf_counter() - t0)
        fwd.append(t1 - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    queue.put((min(fwd[1:]), min(total[1:]), (peak - base) * scale))


def timed(engine, shape, causal, repeats):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_timed_run, args=(engine, shape, causal, repeats, queue))
    proc.start()
    # A child that dies before its result (an exception, a signal, out of
    # memory) must not leave the parent waiting on the queue forever.
    while True:
        try:
            result = queue.get(timeout=0.5)
            break
        except queue_module.Empty:
            if not proc.is_alive() and queue.empty():
                proc.join()
                raise RuntimeError(f"timing {engine} at {shape}: the child process failed "
                                   f"(exit status {proc.exitcode})") from None
    proc.join()
    return result


def engine_lines() -> list[str]:
    """The engines here, best first, then each one left out and why."""
    lines = [f"engines on this machine, best first: {', '.join(_api.backends())}"]
    lines += [f"not available here: {name}: {reason}"
              for name, (reason, _failed) in _engines.missing().items()]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashattn", description=__doc__)
    parser.add_argument("--seq", type=positive_int, default=2048, help="T of the timed shape")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs per engine (best kept)")
    args = parser.parse_args(argv)

    from .. import __version__

    engines = _api.backends()
    print(f"flashattn {__version__}: " + "\n".join(engine_lines()))
    from .._isa import cpu_isa

    print(f"cpu engine threads: {_api.get_num_threads()}, instruction set: {cpu_isa()}")

    check_cases = [
        ((2, 200, 256, 4, 2, 64), True, (-1, -1)),
        ((1, 97, 97, 4, 1, 59), False, (32, 8)),
    ]
    print("\nCorrectness: max |error| of o against the float64 reference, and the ratio of")
    print("the engine's error to plain float32 NumPy's, for o and the worst of dq, dk, dv")
    print("(the tests require o <= 2, gradients <= 3)")
    print(f"  {'engine':<10} {'shape (B, Tq, Tk, H, Hkv, D)':<30} {'options':<22} "
          f"{'o error':>9} {'o ratio':>8} {'grad ratio':>10}")
    failed = []  # (engine, shape) of every check over its bound
    for engine in engines:
        for shape, causal, window in check_cases:
            err, o_ratio, grad_ratio = check(engine, shape, causal, window)
            opts = f"causal={causal} w={window}"
            ok = o_ratio <= 2.0 and grad_ratio <= 3.0  # False for NaN too
            if not ok:
                failed.append(f"{engine} {shape}")
            print(f"  {engine:<10} {str(shape):<30} {opts:<22} {err:9.2e} {o_ratio:8.2f} "
                  f"{grad_ratio:10.2f}" + ("" if ok else "  FAIL"), flush=True)

    shape = (1, args.seq, args.seq, 8, 8, 64)
    print(f"\nForward + backward, B=1, T={args.seq}, H=8, D=64, causal "
          f"(best of {args.repeats}, each in a fresh process)")
    print(f"  {'engine':<12} {'forward ms':>11} {'fwd+bwd ms':>11} {'peak memory beyond inputs':>27}")
    rows = [e for e in engines if e not in _SIMULATED] + ["numpy"]
    for engine in rows:
        try:
            fwd, total, mem = timed(engine, shape, True, args.repeats)
        except RuntimeError as e:
            failed.append(str(e))
            print(f"  {engine:<12} failed: {e}", flush=True)
            continue
        label = engine if engine != "numpy" else "numpy f32"
        print(f"  {label:<12} {fwd * 1e3:11.1f} {total * 1e3:11.1f} {mem / 2**20:23.1f} MiB",
              flush=True)
    skipped = [e for e in engines if e in _SIMULATED]
    if skipped:
        print(f"  ({', '.join(skipped)} simulates the GPU kernels on the CPU: checked above, "
              "not timed)")
    if failed:
        print(f"\nverdict: FAIL: {len(failed)} check(s) failed: "
              f"{'; '.join(failed)}")
        return 1
    print(f"\nverdict: PASS: {', '.join(engines)} match the float64 reference "
          f"({len(engines) * len(check_cases)} checks)")
    return 0
