// A minimal test harness for the C++ tests: CHECK records a failure with its
// location and keeps going; main returns the failure count via finish().
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>

namespace flashattn_test {

inline int& failures() {
    static int n = 0;
    return n;
}

// The case grids under the sanitizer builds: there metal-sim runs one
// std::thread per GPU thread (ASan and TSan cannot follow fibers), which made
// the whole grids take most of CI's time on 2 cores. With FLASHATTN_TEST_EVERY
// = n a grid test runs case i only where i % n == FLASHATTN_TEST_FIRST % n;
// tests/cpp/CMakeLists.txt sets both for the sanitized builds (ASan+UBSan and
// TSan start at different cases, so together they cover more of the grid).
// The plain build sets neither and runs every case.
struct CaseSubset {
    int every = 1, first = 0, seen = 0, run = 0;
};

inline CaseSubset& case_subset() {
    static CaseSubset s = [] {
        CaseSubset c;
        if (const char* e = std::getenv("FLASHATTN_TEST_EVERY")) c.every = std::max(1, std::atoi(e));
        if (const char* f = std::getenv("FLASHATTN_TEST_FIRST")) c.first = std::atoi(f);
        return c;
    }();
    return s;
}

// Call once per case of a grid: whether this one runs.
inline bool case_selected() {
    CaseSubset& s = case_subset();
    const bool take = s.seen++ % s.every == s.first % s.every;
    s.run += take;
    return take;
}

inline int finish(const char* name) {
    const CaseSubset& s = case_subset();
    if (s.run < s.seen)
        std::printf("%s: ran %d of %d grid cases (FLASHATTN_TEST_EVERY=%d, FLASHATTN_TEST_FIRST=%d)\n",
                    name, s.run, s.seen, s.every, s.first);
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
