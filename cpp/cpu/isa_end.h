// Closes the per-ISA region opened by cpu/isa_begin.h.
#if defined(FLASHATTN_TARGET_REGION)
#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
#endif
