#!/usr/bin/env bash
# Runs flashattn's tests against the installed package, announcing each step
# with the time elapsed. Usage, after `pip install ".[test]"`:
#
#   bash tests/run.sh         the fast run (under 10 minutes on 2 cores): the
#                             Python tests (pytest) against the installed
#                             package, without the ones marked `slow`,
#                             metal-sim and the 16-bit dtypes on the smaller
#                             cases only
#   bash tests/run.sh --cpp   the C++ tests first (one build, ctest without
#                             the tests labelled `slow`: the GPU resource gate
#                             over every kernel, metal-sim's thread mode)
#   bash tests/run.sh --all   what CI (.ci/run) runs (about 60 minutes on 2 cores):
#                             every C++ test, then again under AddressSanitizer +
#                             UBSan and ThreadSanitizer (tests/sanitize.sh), every
#                             Python test, the installed package under emulated
#                             x86-64 CPUs without AVX-512 / AVX (tests/qemu_x86.sh)
#                             and the C++ engine tests for arm64 under qemu
#                             (tests/aarch64.sh; these two need x86-64 Linux, and
#                             apt-get what they lack)
#
# env: FLASHATTN_CTEST_BUILD  the C++ test build (default: <repo>/build/ctest)
#      FLASHATTN_JOBS         parallel compile and test jobs (default: 2)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${FLASHATTN_CTEST_BUILD:-$root/build/ctest}
jobs=${FLASHATTN_JOBS:-2}

all=0
steps=(python)
case "${1:-}" in
    "") ;;
    --cpp) steps=(cpp python) ;;
    --all) all=1 ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: bash tests/run.sh [--cpp | --all]" >&2; exit 2 ;;
esac

start=$SECONDS
if [ $all = 1 ]; then
    steps=(cpp sanitize python)
    # The qemu runs emulate other CPUs of x86-64 Linux (qemu-user); elsewhere
    # (a Mac) they cannot run, and are left out with a word.
    if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
        steps+=(qemu_x86 aarch64)
    else
        echo "tests/run.sh --all: the qemu runs need x86-64 Linux; not run on $(uname -s) $(uname -m)"
    fi
fi
step_no=0
summary=()
begin() {  # begin TITLE: one line saying which step of how many, and the time so far
    step_no=$((step_no + 1))
    step_start=$SECONDS
    printf '\n== [%d/%d] %s  (%s elapsed)\n' "$step_no" "${#steps[@]}" "$1" "$(clock $((SECONDS - start)))"
    summary+=("$(printf '%-44s' "$1")")
}
end() {
    summary[-1]+=" $(clock $((SECONDS - step_start)))"
}
clock() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }

for step in "${steps[@]}"; do
    case $step in
    cpp)
        begin "C++ tests: build, then ctest"
        cmake -S "$root" -B "$build" -G Ninja -DFLASHATTN_BUILD_TESTS=ON >/dev/null
        cmake --build "$build" -j "$jobs"
        junit="$build/ctest-junit.xml"
        # The fast run leaves out the tests labelled slow (the GPU resource
        # gate over every kernel, metal-sim's kernel grid in thread mode).
        slow=(); [ $all = 1 ] || slow=(-LE slow)
        ctest --test-dir "$build" --output-on-failure -j "$jobs" --output-junit "$junit" "${slow[@]}"
        [ $all = 1 ] || echo "left to --all: $(ctest --test-dir "$build" -N -L slow | grep -c 'Test *#') slow C++ tests ($(ctest --test-dir "$build" -N -L slow | sed -n 's/.*Test *#[0-9]*: //p' | paste -sd, - | sed "s/,/, /g"))"
        # ctest lists a skipped test without its output: say why it skipped.
        python "$root/tests/ctest_skips.py" "$junit"
        end ;;
    sanitize)
        begin "C++ tests under the sanitizers (tests/sanitize.sh)"
        bash "$root/tests/sanitize.sh"
        end ;;
    python)
        if [ $all = 1 ]; then
            begin "Python tests (pytest), all of them"
            (cd "$root" && python -m pytest -q)
        else
            begin "Python tests (pytest), the fast selection"
            # FLASHATTN_TEST_SIM_BUDGET / _HALF_BUDGET: metal-sim and the 16-bit
            # dtypes get only the cases within them (tests/python/helpers.py);
            # pytest reports how many it deselected.
            (cd "$root" && FLASHATTN_TEST_SIM_BUDGET=${FLASHATTN_TEST_SIM_BUDGET:-500000} \
                FLASHATTN_TEST_HALF_BUDGET=${FLASHATTN_TEST_HALF_BUDGET:-2000000} \
                python -m pytest -q -m "not slow")
        fi
        end ;;
    qemu_x86)
        begin "the package on emulated x86-64 CPUs (tests/qemu_x86.sh)"
        bash "$root/tests/qemu_x86.sh"
        end ;;
    aarch64)
        begin "the C++ engine tests for arm64 under qemu (tests/aarch64.sh)"
        bash "$root/tests/aarch64.sh"
        end ;;
    esac
done

printf '\n== all passed in %s\n' "$(clock $((SECONDS - start)))"
printf '   %s\n' "${summary[@]}"
[ $all = 1 ] || echo "   (bash tests/run.sh --cpp adds the C++ tests; --all, what CI runs, adds the C++ tests, the sanitizer builds, the slow tests and the qemu runs)"
