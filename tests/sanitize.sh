#!/usr/bin/env bash
# Builds the C++ tests under each sanitizer in its own build directory and
# runs them with ctest: AddressSanitizer + UndefinedBehaviorSanitizer (halt on
# the first report; leaks too where LeakSanitizer exists), then
# ThreadSanitizer. What the platform lacks is skipped with a visible line:
# macOS has no LeakSanitizer on arm64 and Apple's ASan aborts on
# detect_leaks=1, so there ASan runs with detect_leaks=0. The sanitizer builds
# leave the metal engine out (FLASHATTN_METAL=OFF): they check the portable
# code, cpu and metal-sim; the GPU side is not instrumented anyway. Every test added
# with flashattn_add_test (tests/cpp/CMakeLists.txt) is labelled `sanitize`
# there and runs here. Called by .ci/run; exits non-zero on the first failure.
#
# usage: tests/sanitize.sh [asan|tsan|all]     (default: all)
# env:   FLASHATTN_SANITIZE_BUILD_ROOT  where the build dirs go (default: <repo>/build/sanitize)
#        FLASHATTN_SANITIZE_JOBS        parallel compile jobs (default: 2)
#        CXX                            compiler (default: the system's c++)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${FLASHATTN_SANITIZE_BUILD_ROOT:-$repo/build/sanitize}"
jobs="${FLASHATTN_SANITIZE_JOBS:-2}"
which="${1:-all}"

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

# run_one NAME SANITIZERS EXTRA_FLAGS
run_one() {
    local name="$1" sanitizers="$2" extra="$3"
    local dir="$root/$name"
    echo "== sanitize: $name (-fsanitize=$sanitizers) in $dir"
    # -O1 keeps the sanitized tests quick without hiding frames; no -march=native
    # so the build is the same on every machine.
    cmake -S "$repo" -B "$dir" "${generator[@]}" \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
        -DCMAKE_CXX_FLAGS="$extra" \
        -DFLASHATTN_BUILD_TESTS=ON \
        -DFLASHATTN_BUILD_PYTHON=OFF \
        -DFLASHATTN_NATIVE=OFF \
        -DFLASHATTN_METAL=OFF \
        -DFLASHATTN_SANITIZE="$sanitizers"
    cmake --build "$dir" -j "$jobs"
    # The runtime options are also set per test in tests/cpp/CMakeLists.txt;
    # exporting them here covers anything run outside that function.
    ctest --test-dir "$dir" --output-on-failure --no-tests=error -L sanitize \
        --output-junit "$dir/ctest-junit.xml"
    # ctest lists a skipped test without its output: say why it skipped.
    python3 "$repo/tests/ctest_skips.py" "$dir/ctest-junit.xml"
}

# LeakSanitizer: Linux only (tests/cpp/CMakeLists.txt makes the same choice).
detect_leaks=1
if [ "$(uname -s)" = Darwin ]; then
    detect_leaks=0
    echo "== sanitize: LeakSanitizer SKIPPED on macOS (none on arm64; Apple's ASan aborts on detect_leaks=1): ASan+UBSan run without leak checks"
fi
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=$detect_leaks:detect_stack_use_after_return=1:strict_string_checks=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"

case "$which" in
    asan) run_one asan-ubsan "address,undefined" "-fno-sanitize-recover=all" ;;
    tsan) run_one tsan "thread" "" ;;
    all)
        run_one asan-ubsan "address,undefined" "-fno-sanitize-recover=all"
        run_one tsan "thread" ""
        ;;
    *) echo "usage: $0 [asan|tsan|all]" >&2; exit 2 ;;
esac
echo "== sanitize: all clean"
