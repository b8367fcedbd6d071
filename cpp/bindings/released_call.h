// Running an engine call with the GIL released, and the process around such
// calls: Ctrl-C (Python's signal handlers run while the call works),
// interpreter exit (calls of daemon threads are stopped and never return to
// Python), and fork (the child counts only the forking thread's calls).
#pragma once
#include <functional>

namespace nanobind {
class module_;
}

namespace flashattn::bindings {

// Runs compute() without the GIL (called with it). On the main thread,
// Python's signal handlers run every ~20 ms while it works
// (core/interrupt.h); when one raises (Ctrl-C: KeyboardInterrupt), the
// engine stops between blocks of work and that exception is raised here,
// the outputs discarded. A handler may call flashattn again: the nested call
// runs inside the poll, which holds no lock of the engines.
//
// During interpreter exit, after the exit hook: a call of the thread that
// runs the exit (its later atexit handlers) runs as usual, or raises
// RuntimeError at once when a call of another thread could not be stopped;
// a call of any other thread (a daemon thread) never returns.
void run_released(const std::function<void()>& compute);

// Defines m._stop_calls_at_exit and registers it with Python's atexit, and
// registers the fork handler; once, at import.
void install_process_hooks(nanobind::module_& m);

}  // namespace flashattn::bindings
