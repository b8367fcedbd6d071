#!/usr/bin/env bash
# Runs the installed flashattn under emulated x86-64 CPUs that lack the
# build machine's instruction sets (qemu-x86_64 user mode): Haswell (AVX2 +
# FMA, no AVX-512) must run the avx2 path and Nehalem (SSE4.2, no AVX) the
# baseline path, both passing the reduced grid (tests/python/cpu_isa_grid.py)
# -- no SIGILL, whatever the build machine had. Forcing a path the emulated
# CPU lacks must be an error, not a crash. Installs qemu-user when missing.
#
# usage: tests/qemu_x86.sh [WHEEL]
#   without WHEEL: the flashattn installed in the current python
#   with WHEEL:    that wheel, installed into a fresh virtual environment
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ "$(uname -m)" = x86_64 ] || { echo "qemu_x86.sh: SKIPPED: not an x86-64 machine"; exit 0; }
if ! command -v qemu-x86_64 >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user >/dev/null
fi

python=python
if [ $# -ge 1 ]; then
    venv=$(mktemp -d /tmp/flashattn-qemu-venv.XXXXXX)
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "$1"
    python="$venv/bin/python"
fi
python=$(command -v "$python")
# Outside the source tree, so the installed package is the one imported.
cd "$(mktemp -d)"

# emulate CPU PYTHON-ARGS...: qemu's notes about CPUID bits TCG lacks are noise.
emulate() {
    local cpu="$1"; shift
    qemu-x86_64 -cpu "$cpu" "$python" "$@" 2> >(grep -v "TCG doesn't support" >&2)
}

for spec in Haswell:avx2 Nehalem:baseline; do
    cpu=${spec%%:*} want=${spec##*:}
    echo "== qemu-x86_64 -cpu $cpu: expect the $want path"
    out=$(emulate "$cpu" "$repo/tests/python/cpu_isa_grid.py")
    echo "$out"
    grep -qx "cpu path: $want" <<<"$out" || { echo "FAIL: $cpu did not use $want"; exit 1; }
    [ "$(tail -n1 <<<"$out")" = ok ] || { echo "FAIL: the grid on $cpu"; exit 1; }
    emulate "$cpu" -m flashattn info | grep "cpu instruction set"
done

echo "== qemu-x86_64 -cpu Haswell, FLASHATTN_CPU_ISA=avx512: an error, not SIGILL"
out=$(FLASHATTN_CPU_ISA=avx512 emulate Haswell -c "
import flashattn as fa
try:
    fa.cpu_isa()
except RuntimeError as e:
    print('RuntimeError:', e)")
echo "$out"
grep -q "RuntimeError: FLASHATTN_CPU_ISA='avx512': this CPU cannot run it" <<<"$out"
echo "qemu_x86.sh: ok"
