// The interrupt flags behind core/interrupt.h: one process-wide flag for
// exit, and a chain of per-thread scopes whose polls are rate-limited so a
// check costs a clock read.
#include "core/interrupt.h"

#include <atomic>
#include <chrono>

namespace flashattn {
namespace {

// Polls (which take the GIL) at most this often: a Ctrl-C is seen within
// this plus one work item.
constexpr long long kPollIntervalNs = 20'000'000;

std::atomic<bool> g_stop_all{false};
thread_local InterruptScope* t_scope = nullptr;

long long now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

}  // namespace

InterruptScope::InterruptScope(std::function<bool()> poll)
    : outer_(t_scope), poll_(std::move(poll)), next_poll_ns_(now_ns() + kPollIntervalNs) {
    t_scope = this;
}

InterruptScope::~InterruptScope() { t_scope = outer_; }

bool interrupt_requested() {
    if (g_stop_all.load(std::memory_order_relaxed)) return true;
    InterruptScope* s = t_scope;
    if (!s) return false;
    if (s->interrupted_) return true;
    const long long now = now_ns();
    if (now < s->next_poll_ns_) return false;
    s->next_poll_ns_ = now + kPollIntervalNs;
    s->interrupted_ = s->poll_ && s->poll_();
    return s->interrupted_;
}

void throw_if_interrupted() {
    if (interrupt_requested()) throw Interrupted();
}

void stop_all_calls() { g_stop_all.store(true); }
bool all_calls_stopped() { return g_stop_all.load(); }
void resume_calls() { g_stop_all.store(false); }

}  // namespace flashattn
