"""The process around a call: Ctrl-C during a long call, interpreter exit with
a daemon thread inside one, fork while another thread is inside one, a
thread count the system cannot give, set_num_threads while a call runs, and
subinterpreters. Each case runs in a fresh interpreter (a subprocess, with
a timeout), so a crash or a hang is a failure here, not of the test run."""

from __future__ import annotations

import re

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import flashattn as fa

# Long calls, per engine: several seconds at least (minutes for some), so
# that being interrupted is not confused with having finished.
LONG = {"cpu": (1, 16384, 8, 64), "metal-sim": (1, 4096, 4, 64), "metal": (1, 32768, 16, 128)}
SETUP = """
import os, signal, sys, threading, time
import numpy as np
import flashattn as fa
backend = {backend!r}
B, T, H, D = {shape}
rng = np.random.default_rng(0)
q = rng.standard_normal((B, T, H, D), dtype=np.float32)
small = rng.standard_normal((1, 33, 2, 16), dtype=np.float32)
def long_call():
    fa.attention(q, q, q, backend=backend)
"""


def run_script(body: str, *, backend="cpu", env=None, timeout=120) -> subprocess.CompletedProcess:
    code = SETUP.format(backend=backend, shape=LONG.get(backend, LONG["cpu"])) + textwrap.dedent(body)
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script hung ({timeout} s); output so far: {e.stdout!r} {e.stderr!r}")


def assert_ok(result: subprocess.CompletedProcess):
    assert result.returncode == 0, (
        f"exit status {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}")
    assert "terminate called" not in result.stderr, result.stderr


# ------------------------------------------------------------------ Ctrl-C

def test_ctrl_c_interrupts_a_long_call(backend):
    """SIGINT 0.5 s into a call of many seconds raises KeyboardInterrupt long
    before the call could have finished (the latency is printed; the bound
    here is only that it was not the end of the call), no thread is left
    working, and the next calls give the same answers as before."""
    result = run_script("""
        before = fa.attention(small, small, small, backend=backend)
        threads = threading.active_count()
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        start = time.perf_counter()
        try:
            long_call()
            print("finished")
        except KeyboardInterrupt:
            latency = time.perf_counter() - start - 0.5
            print(f"interrupted {latency:.3f}")
        timer.join()
        assert threading.active_count() == threads
        after = fa.attention(small, small, small, backend=backend)
        assert np.array_equal(before, after)
        # The engine's pool is idle again: a second interrupt works the same.
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            long_call()
            print("finished")
        except KeyboardInterrupt:
            print("interrupted again")
        timer.join()
    """, backend=backend)
    assert_ok(result)
    lines = result.stdout.split("\n")
    assert lines[0].startswith("interrupted "), result.stdout
    assert float(lines[0].split()[1]) < 10.0, result.stdout  # not at the end of the call
    assert lines[1] == "interrupted again", result.stdout
    print(f"{backend}: KeyboardInterrupt {float(lines[0].split()[1]) * 1000:.0f} ms after SIGINT")


def test_a_signal_handler_that_does_not_raise_lets_the_call_finish():
    """Only a handler that raises stops the call: SIGUSR1 with a handler that
    counts runs during the call, and the call's answer is the usual one."""
    result = run_script("""
        hits = []
        signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
        x = rng.standard_normal((1, 2048, 4, 64), dtype=np.float32)
        want = fa.attention(x, x, x, backend=backend)
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        got = fa.attention(x, x, x, backend=backend)
        timer.join()
        assert np.array_equal(got, want)
        print("ok", len(hits))
    """)
    assert_ok(result)
    assert result.stdout.strip() == "ok 1", result.stdout


# ----------------------------------------------------- interpreter exit

@pytest.mark.parametrize("calls", ["short", "long"])
def test_exit_with_a_daemon_thread_inside_a_call(backend, calls):
    """The main thread returns while a daemon thread is inside a call: the
    process exits with status 0. With short calls one ends while the
    interpreter finalizes (that aborted: "terminate called without an active
    exception"); a long one is stopped at exit."""
    call = "fa.attention(small, small, small, backend=backend)" if calls == "short" else "long_call()"
    for _ in range(3):
        result = run_script(f"""
            def loop():
                while True:
                    {call}
            threading.Thread(target=loop, daemon=True).start()
            time.sleep(0.3)
            print("main done")
        """, backend=backend)
        assert_ok(result)
        assert result.stdout.strip() == "main done"


# ------------------------------------------------------------------ fork

@pytest.mark.skipif(sys.platform == "win32", reason="needs os.fork")
def test_fork_while_another_thread_is_inside_a_call(backend):
    """The child of a fork taken while another thread is inside a call can
    make calls on every engine (metal-sim's launch lock and the cpu pool are
    renewed in the child)."""
    result = run_script("""
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        want = {b: fa.attention(small, small, small, backend=b) for b in ("cpu", "metal-sim")}
        threading.Thread(target=long_call, daemon=True).start()
        time.sleep(0.5)
        pid = os.fork()
        if pid == 0:
            ok = all(np.array_equal(fa.attention(small, small, small, backend=b), want[b])
                     for b in ("cpu", "metal-sim"))
            os._exit(0 if ok else 3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print("child hung")
        os._exit(0)
    """, backend=backend)
    assert_ok(result)
    assert result.stdout.strip() == "child 0", result.stdout + result.stderr


# ---------------------------------------------------------- thread limits

def _memory_limit_prelude(extra_mib: int) -> str:
    """Caps the address space at what the process uses now plus extra_mib:
    far too little for 1024 thread stacks of 8 MiB."""
    return f"""
        import resource
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
        limit = vm + {extra_mib} * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    """


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_thread_count_the_system_cannot_give_is_a_runtime_error():
    result = run_script("""
        fa.set_num_threads(2)
        want = fa.attention(small, small, small, backend="cpu")
    """ + _memory_limit_prelude(256) + """
        try:
            fa.set_num_threads(1024)
            print("no error")
        except RuntimeError as e:
            print("RuntimeError:", e)
        print("threads", fa.get_num_threads())
        assert np.array_equal(fa.attention(small, small, small, backend="cpu"), want)
        fa.set_num_threads(3)
        print("threads", fa.get_num_threads())
    """)
    assert_ok(result)
    lines = result.stdout.strip().split("\n")
    assert lines[0].startswith("RuntimeError: set_num_threads: the system could not start 1024 "
                               "threads"), result.stdout
    assert lines[0].endswith("; keeping 2 threads"), result.stdout
    assert lines[1:] == ["threads 2", "threads 3"], result.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_environment_thread_count_the_system_cannot_give_is_a_runtime_error():
    import os
    env = dict(os.environ, FLASHATTN_NUM_THREADS="1024")
    result = run_script(_memory_limit_prelude(256) + """
        for _ in range(2):  # the pool stays unbuilt, and says so again
            try:
                fa.attention(small, small, small, backend="cpu")
                print("no error")
            except RuntimeError as e:
                print("RuntimeError:", e)
    """, env=env)
    assert_ok(result)
    lines = result.stdout.strip().split("\n")
    # Both calls fail the same way; how many threads the system gave before
    # it stopped depends on the machine's load, so that count may differ.
    same = [re.sub(r"stopped after \d+", "stopped after N", line) for line in lines]
    assert len(lines) == 2 and same[0] == same[1], result.stdout
    assert lines[0].startswith("RuntimeError: cpu engine: the system could not start 1024 threads")
    assert lines[0].endswith("(FLASHATTN_NUM_THREADS=1024)"), result.stdout


def test_set_num_threads_waits_without_the_gil(restore_threads):
    """set_num_threads waits for a running cpu call; meanwhile other Python
    threads keep running (it used to hold the GIL: 3-5 s of silence)."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 16384, 4, 64), dtype=np.float32)
    call_ended = []
    worker = threading.Thread(target=lambda: (fa.attention(q, q, q, backend="cpu"),
                                              call_ended.append(time.perf_counter())))
    worker.start()
    time.sleep(0.2)
    start = time.perf_counter()
    setter = threading.Thread(target=fa.set_num_threads, args=(1,))
    setter.start()
    ticks = [start]
    while setter.is_alive():
        time.sleep(0.005)
        ticks.append(time.perf_counter())
    worker.join()
    assert fa.get_num_threads() == 1
    if call_ended[0] - start < 1.0:  # the premise: a long wait to stand still in
        pytest.skip(f"the cpu call ended {call_ended[0] - start:.2f} s after set_num_threads "
                    "began: too soon to tell")
    gap = np.diff(ticks).max()
    assert gap < 0.5, f"Python stood still {gap:.2f} s while set_num_threads waited"


# -------------------------------------------------------- subinterpreters

def test_import_in_a_subinterpreter_is_an_import_error():
    result = run_script("""
        try:
            import _xxsubinterpreters as interpreters
        except ImportError:
            try:
                import _interpreters as interpreters
            except ImportError:
                print("no subinterpreter module")
                sys.exit(0)
        sub = interpreters.create()
        try:
            interpreters.run_string(sub, "import flashattn")
            print("imported")
        except Exception as e:  # RunFailedError (3.11, 3.12), or what run_string returns
            print(type(e).__name__, e)
    """, timeout=60)
    assert_ok(result)
    if result.stdout.strip() == "no subinterpreter module":
        pytest.skip("this Python has no subinterpreter module")
    assert "ImportError" in result.stdout and "subinterpreter" in result.stdout, result.stdout
