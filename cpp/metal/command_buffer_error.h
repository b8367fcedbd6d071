// Which hint follows a failed command buffer's message, decided from the
// NSError's code and text in portable C++ (device.mm only extracts them), so
// that tests/cpp/test_metal_command_buffer_error.cpp checks it on every
// platform.
//
// macOS stops a command buffer that runs too long in two ways, and both call
// for the same remedy (smaller pieces of work per command buffer):
//   - the GPU timeout: MTLCommandBufferErrorTimeout (code 2), described as
//     "Caused GPU Timeout Error (00000002:kIOGPUCommandBufferCallbackErrorTimeout)";
//   - "Impacting Interactivity": the GPU was kept from the window server too
//     long. Metal's public headers have no code for it; what reports show
//     (MLX's "[METAL] Command buffer execution failed: ..." prints the
//     NSError's localizedDescription) is the text
//     "Impacting Interactivity (0000000e:kIOGPUCommandBufferCallbackErrorImpactingInteractivity)".
//     So it is recognised by its text, never by a guessed code.
#pragma once
#include <string>

namespace flashattn::metal {

// MTLCommandBufferErrorTimeout's value in <Metal/MTLCommandBuffer.h>
// (device.mm static_asserts that they agree).
constexpr long kCommandBufferErrorTimeout = 2;

enum class CommandBufferHint { none, watchdog };

// `text`: every description the NSError carries (its localizedDescription and
// its underlying errors'), joined.
inline CommandBufferHint command_buffer_hint(long code, const std::string& text) {
    if (code == kCommandBufferErrorTimeout) return CommandBufferHint::watchdog;
    for (const char* name : {"ImpactingInteractivity", "Impacting Interactivity"})
        if (text.find(name) != std::string::npos) return CommandBufferHint::watchdog;
    return CommandBufferHint::none;
}

// What follows Metal's message: empty, or how to make the pieces smaller
// (core/chunks.h cuts each launch into pieces of bounded time).
inline std::string command_buffer_hint_text(long code, const std::string& text) {
    switch (command_buffer_hint(code, text)) {
        case CommandBufferHint::watchdog:
            return ". The GPU watchdog stopped it: set FLASHATTN_MAX_GROUPS_PER_PIECE to a smaller "
                   "number of threadgroups per piece";
        case CommandBufferHint::none:
            break;
    }
    return {};
}

}  // namespace flashattn::metal
