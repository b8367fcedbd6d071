// The metal host's hint after a failed command buffer
// (cpp/metal/command_buffer_error.h): a GPU timeout and macOS's "Impacting
// Interactivity" kill both get the watchdog hint; other failures get none.
// The texts are the localizedDescriptions that reports of these failures
// quote (MLX, llama.cpp, wgpu issue threads).
#include <string>

#include "check.h"
#include "metal/command_buffer_error.h"

using namespace flashattn::metal;

int main() {
    const std::string timeout =
        "Caused GPU Timeout Error (00000002:kIOGPUCommandBufferCallbackErrorTimeout)";
    const std::string interactivity =
        "Impacting Interactivity (0000000e:kIOGPUCommandBufferCallbackErrorImpactingInteractivity)";
    const std::string out_of_memory =
        "Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)";
    const std::string page_fault = "Caused GPU Address Fault Error (0000000b:kIOGPUCommandBufferCallbackErrorPageFault)";

    // A timeout, by its code, whatever the text.
    CHECK(command_buffer_hint(kCommandBufferErrorTimeout, timeout) == CommandBufferHint::watchdog);
    CHECK(command_buffer_hint(kCommandBufferErrorTimeout, "") == CommandBufferHint::watchdog);
    // Impacting Interactivity, by its text, whatever code Metal gives it
    // (none is public): the IOAF number 14, Internal (1), or the text of an
    // underlying error appended after the top-level description.
    CHECK(command_buffer_hint(14, interactivity) == CommandBufferHint::watchdog);
    CHECK(command_buffer_hint(1, interactivity) == CommandBufferHint::watchdog);
    CHECK(command_buffer_hint(1, "Internal Error; " + interactivity) == CommandBufferHint::watchdog);
    CHECK(command_buffer_hint(1, "Impacting Interactivity") == CommandBufferHint::watchdog);
    CHECK(command_buffer_hint(1, "kIOGPUCommandBufferCallbackErrorImpactingInteractivity") ==
          CommandBufferHint::watchdog);
    // Not a watchdog: no hint, and no guess from an undocumented code alone.
    CHECK(command_buffer_hint(8, out_of_memory) == CommandBufferHint::none);
    CHECK(command_buffer_hint(3, page_fault) == CommandBufferHint::none);
    CHECK(command_buffer_hint(14, "") == CommandBufferHint::none);
    CHECK(command_buffer_hint(0, "") == CommandBufferHint::none);

    // Both watchdog kinds read the same hint; the others read nothing.
    const std::string hint = command_buffer_hint_text(kCommandBufferErrorTimeout, timeout);
    CHECK(hint.find("GPU watchdog") != std::string::npos);
    CHECK(hint.find("FLASHATTN_MAX_GROUPS_PER_PIECE") != std::string::npos);
    CHECK(command_buffer_hint_text(14, interactivity) == hint);
    CHECK(command_buffer_hint_text(8, out_of_memory).empty());
    return flashattn_test::finish("test_metal_command_buffer_error");
}
