// A cpu call's parallel work as phases of independent tasks: phase k + 1
// starts when every task of phase k is done (the forward's split-KV merge
// after its tiles; the backward's row deltas, then its key chunks, then the
// sums of their partials). An ordinary call runs its phases one
// parallel_for each (run_phases); a variable-length batch builds one per
// sequence and runs the same phase of all of them in one parallel loop
// (cpu/varlen.cpp), so short sequences share the threads.
#pragma once
#include <cstdint>
#include <memory>

#include "core/engine.h"

namespace flashattn::cpu {

class CallPhases {
public:
    virtual ~CallPhases() = default;
    virtual int phases() const = 0;
    virtual int64_t tasks(int phase) const = 0;
    // Tasks of one phase run concurrently and write disjoint memory; which
    // thread runs one never changes what it computes.
    virtual void run(int phase, int64_t task) = 0;
};

// Each phase in order, one parallel_for each.
void run_phases(CallPhases& call);

// How a call that shares its parallel loops with others (the sequences of
// a varlen batch) is cut into tasks: `other_tasks` is at least the number of
// tasks the others bring, so a call that is short of tasks alone does not
// split its keys to fill the cores (split-KV, the backward's key chunks)
// when the others fill them. It depends on the shapes alone, never on the
// thread count, so neither do the results.
struct Sharing {
    int64_t other_tasks = 0;
};

// The call's phases, on the instruction-set path in use (dispatch.cpp).
std::unique_ptr<CallPhases> forward_phases(const FlashParams& p, const ForwardIO& io,
                                           Sharing sharing);
std::unique_ptr<CallPhases> backward_phases(const FlashParams& p, const BackwardIO& io,
                                            Sharing sharing);

}  // namespace flashattn::cpu
