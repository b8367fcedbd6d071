#!/usr/bin/env bash
# Cross-compiles the cpu engine's C++ tests for arm64 (Debian's
# g++-aarch64-linux-gnu) and runs them under qemu-aarch64 user mode: the NEON
# path's correctness on a machine without an arm64 CPU. It says nothing about
# speed (qemu translates every instruction; Apple CPUs cannot be timed here).
# Installs the cross toolchain and qemu-user with apt-get when missing.
#
# usage: tests/aarch64.sh
# env:   FLASHATTN_AARCH64_BUILD  build dir (default: <repo>/build/aarch64)
#        FLASHATTN_JOBS           parallel compile jobs (default: 2)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FLASHATTN_AARCH64_BUILD:-$repo/build/aarch64}"
jobs="${FLASHATTN_JOBS:-2}"
sysroot=/usr/aarch64-linux-gnu

if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null
fi

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S "$repo" -B "$build" "${generator[@]}" \
    -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
    -DCMAKE_CROSSCOMPILING_EMULATOR="qemu-aarch64;-L;$sysroot" \
    -DFLASHATTN_BUILD_TESTS=ON -DFLASHATTN_BUILD_PYTHON=OFF >/dev/null
tests=(test_cpu_dispatch test_cpu_engine test_params test_sim_vs_cpu)
cmake --build "$build" -j "$jobs" --target "${tests[@]}"
# ctest runs each through the emulator (CMAKE_CROSSCOMPILING_EMULATOR).
ctest --test-dir "$build" --output-on-failure -j "$jobs" \
    -R "^(test_cpu_dispatch|test_cpu_engine|test_cpu_dispatch_unknown|test_params|test_sim_vs_cpu)$"
