#!/usr/bin/env bash
# Runs every test of flashattn against the installed package: the C++ tests
# (ctest, normal build and sanitizer builds) and the Python tests (pytest).
# Usage: bash tests/run.sh   (after `pip install ".[test]"`)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${FLASHATTN_CTEST_BUILD:-$root/build/ctest}
jobs=${FLASHATTN_JOBS:-2}

echo "== C++ tests (ctest)"
cmake -S "$root" -B "$build" -G Ninja -DFLASHATTN_BUILD_TESTS=ON >/dev/null
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"

if [ -f "$root/tests/sanitize.sh" ]; then
  echo "== C++ tests under sanitizers"
  bash "$root/tests/sanitize.sh"
fi

echo "== Python tests (pytest)"
cd "$root"
python -m pytest -q
