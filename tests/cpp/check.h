// A minimal test harness for the C++ tests: CHECK records a failure with its
// location and keeps going; main returns the failure count via finish().
#pragma once
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

namespace flashattn_test {

inline int& failures() {
    static int n = 0;
    return n;
}

inline int finish(const char* name) {
    if (failures() == 0) std::printf("%s: all checks passed\n", name);
    else std::printf("%s: %d check(s) FAILED\n", name, failures());
    return failures() == 0 ? 0 : 1;
}

}  // namespace flashattn_test

#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (!(cond)) {                                                                \
            std::printf("%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);     \
            ++flashattn_test::failures();                                             \
        }                                                                             \
    } while (0)

// Runs `stmt`, which must throw `Exc` whose message contains `needle`.
#define CHECK_THROWS(Exc, needle, stmt)                                               \
    do {                                                                              \
        bool thrown_ = false;                                                         \
        try {                                                                         \
            stmt;                                                                     \
        } catch (const Exc& e_) {                                                     \
            thrown_ = std::string(e_.what()).find(needle) != std::string::npos;      \
            if (!thrown_)                                                             \
                std::printf("%s:%d: message '%s' lacks '%s'\n", __FILE__, __LINE__,  \
                            e_.what(), needle);                                       \
        } catch (...) {                                                               \
        }                                                                             \
        if (!thrown_) {                                                               \
            std::printf("%s:%d: CHECK_THROWS failed: %s\n", __FILE__, __LINE__, #stmt); \
            ++flashattn_test::failures();                                             \
        }                                                                             \
    } while (0)
