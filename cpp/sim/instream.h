// The in-stream paths' generated kernel texts (python/flashattn/_instream),
// compiled by metal-sim: each as MLX's metal_kernel or torch's
// compile_shader would compile it, registered under its key (the text's
// digest without its function-constants block, source.text_key). Written at
// build time by cpp/sim/generate_instream.py; the launcher runs them as it
// runs the shipped kernels (sim/launcher.h).
#pragma once
#include <vector>

#include "sim/launcher.h"

namespace flashattn::sim {

// Every generated text, by key.
const std::vector<Kernel>& instream_kernels();

}  // namespace flashattn::sim
