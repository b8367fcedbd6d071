// The calls in flight behind bindings/released_call.h: a count of the calls
// between releasing and retaking the GIL, which the exit hook waits on and a
// forked child trims to its own thread's, and the signal poll.
//
// Not nb::gil_scoped_release: its destructor (noexcept) takes the GIL back,
// and a daemon thread that does so while the interpreter is finalizing is
// ended by Python with a forced unwind, which a noexcept frame turns into
// std::terminate. Here instead the exit hook (stop_calls_at_exit) first
// stops every call and waits for it; a call of another thread that ends
// after that never takes the GIL again: its thread sleeps until the process
// is gone.
#include "bindings/released_call.h"

#include <nanobind/nanobind.h>
#include <pthread.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <thread>

#include "core/interrupt.h"

namespace nb = nanobind;

namespace flashattn::bindings {
namespace {

std::mutex g_calls_mutex;
std::condition_variable g_calls_changed;
int g_calls_running = 0;        // calls between releasing and retaking the GIL
thread_local int t_calls_running = 0;  // of them, this thread's (a signal handler may nest one)
bool g_exiting = false;         // the exit hook has begun
std::thread::id g_exit_thread;  // the thread that runs the exit (and the atexit handlers)
bool g_exit_stopped_all = false;  // every call running at the hook ended in time

// How long the exit hook waits for the running calls to stop (each checks
// between blocks of its work, so this is a bound, not the usual wait).
constexpr auto kExitWait = std::chrono::seconds(10);

[[noreturn]] void sleep_until_process_exit() {
    for (;;) pause();
}

// A forked child has only the forking thread: the calls of the others are
// not running there, and would hold the exit hook for kExitWait. The lock
// and the condition may have been held by one of them: fresh ones.
void keep_this_threads_calls_in_child() {
    new (&g_calls_mutex) std::mutex();
    new (&g_calls_changed) std::condition_variable();
    g_calls_running = t_calls_running;
}

// Only the main thread of the main interpreter runs Python's signal handlers.
bool on_main_thread() {
    static PyObject* main_thread =  // never released: it outlives the interpreter
        nb::object(nb::module_::import_("threading").attr("main_thread")).release().ptr();
    nb::object thread = nb::steal(PyObject_CallNoArgs(main_thread));
    if (!thread.is_valid()) throw nb::python_error();
    return nb::cast<unsigned long>(thread.attr("ident")) == PyThread_get_thread_ident();
}

enum class Entry { run, park, refuse };

// Counts the call in, unless the exit hook has begun: then the exit's own
// thread runs it (or is refused, when a stopped call never ended) and any
// other thread parks.
Entry enter() {
    std::lock_guard<std::mutex> lock(g_calls_mutex);
    Entry entry = Entry::run;
    if (g_exiting)
        entry = std::this_thread::get_id() != g_exit_thread ? Entry::park
                : g_exit_stopped_all                        ? Entry::run
                                                            : Entry::refuse;
    if (entry == Entry::run) ++g_calls_running, ++t_calls_running;
    return entry;
}

void leave_locked() {
    --g_calls_running, --t_calls_running;
    g_calls_changed.notify_all();
}

// atexit: after the non-daemon threads are joined and before the
// interpreter finalizes. Every running call stops at its next check; wait
// (without the GIL) until each has parked or returned to Python. Then the
// stop is undone, so that this thread's later calls (atexit handlers
// registered before flashattn was imported run after this one) work.
void stop_calls_at_exit() {
    stop_all_calls();
    PyThreadState* state = PyEval_SaveThread();
    {
        std::unique_lock<std::mutex> lock(g_calls_mutex);
        g_exiting = true;
        g_exit_thread = std::this_thread::get_id();
        const int own = t_calls_running;  // (a handler nested in this thread's call)
        g_exit_stopped_all = g_calls_changed.wait_for(
            lock, kExitWait, [own] { return g_calls_running == own; });
        if (g_exit_stopped_all) resume_calls();
    }
    PyEval_RestoreThread(state);
}

}  // namespace

void run_released(const std::function<void()>& compute) {
    const bool poll_signals = on_main_thread();
    switch (enter()) {
        case Entry::run:
            break;
        case Entry::park:  // a daemon thread calling in during exit: never returns
            PyEval_SaveThread();
            sleep_until_process_exit();
        case Entry::refuse:
            throw std::runtime_error(
                "flashattn: called during interpreter exit, after flashattn's exit hook, while a "
                "call of another thread it stopped had not ended; make the call before exit "
                "(or register the atexit handler after importing flashattn)");
    }
    PyObject *err_type = nullptr, *err_value = nullptr, *err_trace = nullptr;
    PyThreadState* state = PyEval_SaveThread();
    bool interrupted = false;
    std::exception_ptr failure;
    try {
        std::optional<InterruptScope> scope;
        if (poll_signals)
            scope.emplace([&] {
                PyEval_RestoreThread(state);
                const bool raised = PyErr_CheckSignals() != 0;
                if (raised) PyErr_Fetch(&err_type, &err_value, &err_trace);
                state = PyEval_SaveThread();
                return raised;
            });
        compute();
    } catch (const Interrupted&) {
        interrupted = true;
    } catch (...) {
        failure = std::current_exception();
    }
    // Once the exit hook has begun, another thread's call parks; until then
    // the GIL may be taken back: the hook waits for this call (it is still
    // counted) before the interpreter finalizes, so Python cannot end this
    // thread mid-frame. The exit's own thread goes on.
    {
        std::unique_lock<std::mutex> lock(g_calls_mutex);
        if (g_exiting && std::this_thread::get_id() != g_exit_thread) {
            leave_locked();
            lock.unlock();
            sleep_until_process_exit();
        }
    }
    PyEval_RestoreThread(state);
    {
        std::lock_guard<std::mutex> lock(g_calls_mutex);
        leave_locked();
    }
    if (err_type) {
        PyErr_Restore(err_type, err_value, err_trace);
        throw nb::python_error();
    }
    if (failure) std::rethrow_exception(failure);
    if (interrupted) throw std::runtime_error("flashattn: the call was interrupted");
}

void install_process_hooks(nb::module_& m) {
    static std::once_flag once;
    std::call_once(once, [] { pthread_atfork(nullptr, nullptr, keep_this_threads_calls_in_child); });
    m.def("_stop_calls_at_exit", &stop_calls_at_exit);
    nb::module_::import_("atexit").attr("register")(m.attr("_stop_calls_at_exit"));
}

}  // namespace flashattn::bindings
