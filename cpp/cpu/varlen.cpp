// The cpu engine's variable-length batch (core Varlen) in one parallel loop
// per phase: each sequence with work is cut into tasks as an ordinary call
// of its shape would be (cpu/call_phases.h, told how many tasks the other
// sequences bring, so that a short call does not split its keys to fill
// cores the others fill), and the same phase of every sequence runs as one
// parallel_for, the sequences' tasks ordered by their estimated work,
// longest first (a thread that takes a long task last would leave the
// others idle at the end). One call per sequence, as before, ran a
// parallel_for of a single task for each short sequence: one thread busy.
#include <algorithm>
#include <memory>
#include <numeric>
#include <vector>

#include "cpu/attention.h"
#include "cpu/call_phases.h"
#include "cpu/thread_pool.h"

namespace flashattn::cpu {
namespace {

// The (query, key) pairs a sequence's rows see, times its heads: its work.
double sequence_work(const FlashParams& s) {
    double pairs = 0;
    for (int64_t i = 0; i < s.Tq; ++i)
        pairs += double(std::max<fa_long>(0, fa_key_end(i, s.Tq, s.Tk, s.window_right) -
                                                 fa_key_begin(i, s.Tq, s.Tk, s.window_left)));
    return pairs * s.H;
}

template <class IO, class MakePhases>
void run_varlen(const Varlen& call, const IO& io, MakePhases make_phases) {
    std::vector<size_t> busy;  // the sequences with work
    for (size_t i = 0; i < call.seqs.size(); ++i)
        if (sequence_has_work(call.seqs[i])) busy.push_back(i);
    const Sharing sharing{int64_t(busy.size()) - 1};
    // Each sequence's phases are made on the pool too: making them takes
    // each sequence's workspace, and at hundreds of short sequences that was
    // a serial stretch of the call. (A maker's own parallel_for, the AMX
    // backward's pairing of q and do, runs nested: its caller works its
    // own job, thread_pool.h.)
    std::vector<std::unique_ptr<CallPhases>> calls(busy.size());
    std::vector<double> work(busy.size());
    parallel_for(int64_t(busy.size()), [&](int64_t c) {
        const size_t i = busy[size_t(c)];
        calls[size_t(c)] = make_phases(call.seqs[i], sequence_io(call, io, i), sharing);
        work[size_t(c)] = sequence_work(call.seqs[i]);
    });
    int phases = 0;
    for (const auto& c : calls) phases = std::max(phases, c->phases());
    struct Task {
        CallPhases* call;
        int64_t index;
    };
    std::vector<Task> tasks;
    std::vector<size_t> order(calls.size());
    for (int phase = 0; phase < phases; ++phase) {
        // Longest tasks first: each sequence's work shared evenly among its
        // tasks of this phase; ties keep the batch order (and each call's own
        // order of its tasks, which puts its heaviest tiles first).
        auto per_task = [&](size_t c) {
            return phase < calls[c]->phases() ? work[c] / double(calls[c]->tasks(phase)) : 0.0;
        };
        std::iota(order.begin(), order.end(), size_t(0));
        std::stable_sort(order.begin(), order.end(),
                         [&](size_t a, size_t b) { return per_task(a) > per_task(b); });
        tasks.clear();
        for (size_t c : order)
            if (phase < calls[c]->phases())
                for (int64_t t = 0; t < calls[c]->tasks(phase); ++t)
                    tasks.push_back(Task{calls[c].get(), t});
        parallel_for(int64_t(tasks.size()), [&](int64_t t) {
            tasks[size_t(t)].call->run(phase, tasks[size_t(t)].index);
        });
    }
}

}  // namespace

void attention_forward_varlen(const Varlen& call, const ForwardIO& io) {
    run_varlen(call, io, forward_phases);
}

void attention_backward_varlen(const Varlen& call, const BackwardIO& io) {
    run_varlen(call, io, backward_phases);
}

}  // namespace flashattn::cpu
