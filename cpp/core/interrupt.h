// Stopping a running call early: Ctrl-C in Python, or the interpreter
// exiting while a thread is inside a call. Engines check between work items
// (the cpu pool's tasks, metal-sim's threadgroups and launches) and throw
// Interrupted; the caller then discards the call's outputs.
#pragma once
#include <exception>
#include <functional>

namespace flashattn {

// What an engine throws when its call was interrupted. Its outputs hold
// nothing meaningful; every other state (pools, locks) is as before the call.
struct Interrupted : std::exception {
    const char* what() const noexcept override { return "flashattn: call interrupted"; }
};

// While alive, `poll` is asked (on the thread that created the scope, at most
// every kPollInterval) whether the call should stop; once it says yes, every
// later check on that thread says yes. The binding's poll looks for Python
// signals; without a scope only stop_all_calls() interrupts.
class InterruptScope {
public:
    explicit InterruptScope(std::function<bool()> poll);
    ~InterruptScope();
    InterruptScope(const InterruptScope&) = delete;
    InterruptScope& operator=(const InterruptScope&) = delete;

private:
    InterruptScope* outer_;
    std::function<bool()> poll_;
    long long next_poll_ns_ = 0;
    bool interrupted_ = false;
    friend bool interrupt_requested();
};

// True when the call running on this thread should stop: its scope's poll
// said so, or stop_all_calls() was called. Cheap enough to call per task.
bool interrupt_requested();

// Throws Interrupted when interrupt_requested().
void throw_if_interrupted();

// From now on every check, on every thread, says stop (interpreter exit).
void stop_all_calls();
bool all_calls_stopped();

// Undoes stop_all_calls: the exit hook's, once every call it stopped has
// ended, so that calls made later during exit (atexit handlers that ran
// after it) run as usual.
void resume_calls();

}  // namespace flashattn
