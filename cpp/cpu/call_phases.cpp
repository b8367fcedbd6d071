// Running a cpu call's phases (call_phases.h): one parallel_for per phase.
#include "cpu/call_phases.h"

#include "cpu/thread_pool.h"

namespace flashattn::cpu {

void run_phases(CallPhases& call) {
    for (int phase = 0; phase < call.phases(); ++phase)
        parallel_for(call.tasks(phase), [&](int64_t t) { call.run(phase, t); });
}

}  // namespace flashattn::cpu
