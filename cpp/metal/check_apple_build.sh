#!/usr/bin/env bash
# Exercises the APPLE half of the CMake build on Linux: configures the project
# for arm64 macOS 14 (clang-16 with the macOS SDK headers as sysroot, a
# stand-in `xcrun` that records the Metal compiler commands instead of running
# them), builds every static library including flashattn_metal (.mm files as
# Objective-C++ with ARC), and checks that
#   - each shaders/*.metal is compiled with -std=metal3.1 (bfloat), -fno-fast-math, the safe-math
#     flags the configure-time probe found, and the same minimum macOS as the
#     extension, and linked into one flashattn.metallib;
#   - FLASHATTN_METAL: with a Metal compiler that rejects the safe-math flags
#     they are left out; with no working Metal compiler (Command Line Tools
#     only, or Xcode 26 without its Metal Toolchain) AUTO builds the cpu and
#     metal-sim engines and says why metal was left out, ON fails, OFF never
#     probes;
#   - a change to a shared shader header recompiles every shader;
#   - every Metal/Foundation symbol flashattn_metal needs is exported by the
#     SDK's Metal.tbd / Foundation.tbd (a link-time check without a linker).
# It cannot run anything: Metal itself is exercised by the macOS workflow.
#
# usage: cpp/metal/check_apple_build.sh [SDK_DIR]
#   SDK_DIR defaults to the sysroot ../shared/tools/macos-sdk.sh lays out
#   (it needs MACOS_SDK_GIT, see ../shared/metal-checks.md).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
sdk=${1:-}
if [ -z "$sdk" ]; then
  sdk=$("$repo/../shared/tools/macos-sdk.sh")
fi
[ -d "$sdk/System/Library/Frameworks/Metal.framework" ] || { echo "no macOS SDK at $sdk" >&2; exit 2; }
for tool in clang++-16 llvm-ar-16 llvm-ranlib-16 llvm-nm-16 llvm-install-name-tool-16 cmake ninja; do
  command -v "$tool" >/dev/null || { echo "check_apple_build.sh: needs $tool" >&2; exit 2; }
done

work=$(mktemp -d /tmp/flashattn-apple-build.XXXXXX)
[ -n "${KEEP_WORK:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
# XCRUN_MODE: full (accepts everything), old (a Metal compiler without the
# -fmetal-math-* flags), none (Xcode 26 without its Metal Toolchain).
cat > "$work/bin/xcrun" <<EOF
#!/usr/bin/env bash
echo "xcrun \$*" >> "$work/xcrun.log"
case "\${XCRUN_MODE:-full}" in
  none) echo "error: cannot execute tool 'metal' due to missing Metal Toolchain; use: xcodebuild -downloadComponent MetalToolchain" >&2; exit 72 ;;
  old) case " \$* " in *" -fmetal-math-"*) echo "metal: error: unknown argument: '\$*'" >&2; exit 1 ;; esac ;;
esac
out=""; prev=""
for a in "\$@"; do [ "\$prev" = "-o" ] && out="\$a"; prev="\$a"; done
[ -z "\$out" ] || echo "stand-in output of: xcrun \$*" > "\$out"
EOF
chmod +x "$work/bin/xcrun"
cat > "$work/toolchain.cmake" <<EOF
set(CMAKE_SYSTEM_NAME Darwin)
set(CMAKE_SYSTEM_PROCESSOR arm64)
set(CMAKE_OSX_SYSROOT $sdk)
set(CMAKE_OSX_ARCHITECTURES arm64)
set(CMAKE_C_COMPILER clang-16)
set(CMAKE_CXX_COMPILER clang++-16)
set(CMAKE_OBJCXX_COMPILER clang++-16)
set(CMAKE_C_COMPILER_TARGET arm64-apple-macos14)
set(CMAKE_CXX_COMPILER_TARGET arm64-apple-macos14)
set(CMAKE_OBJCXX_COMPILER_TARGET arm64-apple-macos14)
set(CMAKE_AR $(command -v llvm-ar-16))
set(CMAKE_RANLIB $(command -v llvm-ranlib-16))
set(CMAKE_INSTALL_NAME_TOOL $(command -v llvm-install-name-tool-16))
set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
EOF

export PATH="$work/bin:$PATH"
build="$work/build"
echo "== configure for arm64-apple-macos14"
cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$work/toolchain.cmake" \
  -DFLASHATTN_NATIVE=OFF -DFLASHATTN_BUILD_PYTHON=OFF -DFLASHATTN_BUILD_TESTS=OFF >/dev/null
echo "== build the static libraries and the metallib"
cmake --build "$build" -j 2 --target flashattn_engines flashattn_metallib

status=0
fail() { echo "FAIL: $*"; status=1; }
log="$work/xcrun.log"
for shader in "$repo"/shaders/*.metal; do
  line=$(grep -F -- "-c $shader " "$log" || true)
  [ -n "$line" ] || { fail "$(basename "$shader") was not compiled"; continue; }
  for flag in -std=metal3.1 -fno-fast-math -fmetal-math-mode=safe -fmetal-math-fp32-functions=precise \
              -mmacosx-version-min=14.0 -Wall -Wextra; do
    case " $line " in *" $flag "*) ;; *) fail "$(basename "$shader") compiled without $flag";; esac
  done
done
grep -q "metallib .* -o $build/cpp/metal/flashattn.metallib" "$log" || fail "no flashattn.metallib link step"
echo "ok: $(grep -c -- "-c $repo/shaders/" "$log") shader(s) compiled (safe-math flags probed and used), linked into flashattn.metallib"

: > "$log"
touch "$repo/shaders/flash_params.h"
cmake --build "$build" --target flashattn_metallib >/dev/null
n_shaders=$(ls "$repo"/shaders/*.metal | wc -l)
[ "$(grep -c ' metal ' "$log")" -eq "$n_shaders" ] || fail "a shared header change did not recompile every shader"
echo "ok: a change to shaders/flash_params.h recompiles all $n_shaders shader(s)"

# Foundation re-exports CoreFoundation (where NSURL and the CF* functions
# live); IOKit has the registry calls that read the GPU's core count.
frameworks="$sdk/System/Library/Frameworks"
tbds=("$frameworks/Metal.framework/Metal.tbd" "$frameworks/Foundation.framework/Foundation.tbd"
      "$frameworks/CoreFoundation.framework/CoreFoundation.tbd" "$frameworks/IOKit.framework/IOKit.tbd")
missing=0
while read -r sym; do
  case "$sym" in
    _OBJC_CLASS_\$_*) pattern="(^|[^A-Za-z0-9_])${sym#_OBJC_CLASS_\$_}([^A-Za-z0-9_]|$)" ;;  # listed by class name
    *) pattern="(^|[^A-Za-z0-9_])${sym}([^A-Za-z0-9_]|$)" ;;                              # C symbols keep their _
  esac
  if ! grep -qE -- "$pattern" "${tbds[@]}"; then
    fail "symbol $sym is not exported by Metal, Foundation or IOKit"; missing=1
  fi
done < <(llvm-nm-16 -u "$build/cpp/metal/libflashattn_metal.a" | grep -E '^_(OBJC_CLASS_\$_)?(MTL|NS|IO|CF|kIO|kCF)' | sort -u)
[ $missing -eq 0 ] && echo "ok: every MTL*/NS*/IO*/CF* symbol of flashattn_metal is exported by the SDK's Metal/Foundation/IOKit .tbd"

# configure_case NAME FLASHATTN_METAL XCRUN_MODE: configures a fresh build dir,
# leaving its output in $work/NAME.out and its status in $?.
configure_case() {
  local name=$1 choice=$2 mode=$3
  before=$status
  : > "$log"
  XCRUN_MODE=$mode cmake -S "$repo" -B "$work/$name" -G Ninja \
    -DCMAKE_TOOLCHAIN_FILE="$work/toolchain.cmake" -DFLASHATTN_METAL="$choice" \
    -DFLASHATTN_NATIVE=OFF -DFLASHATTN_BUILD_PYTHON=OFF -DFLASHATTN_BUILD_TESTS=OFF \
    > "$work/$name.out" 2>&1
}

echo "== a Metal compiler without the safe-math flags"
if configure_case old AUTO old; then
  XCRUN_MODE=old cmake --build "$work/old" --target flashattn_metallib >/dev/null
  line=$(grep -F -- "-c $repo/shaders/" "$log" | head -1)
  case " $line " in *" -fno-fast-math "*) ;; *) fail "old compiler: -fno-fast-math missing";; esac
  case " $line " in *" -fmetal-math-"*) fail "old compiler: rejected flag passed: $line";; *) ;; esac
  [ $status -eq $before ] && echo "ok: flags it rejects are left out, -fno-fast-math kept"
else
  fail "old compiler: configure failed: $(tail -5 "$work/old.out")"
fi

echo "== no working Metal compiler (Xcode 26 without the Metal Toolchain), FLASHATTN_METAL=AUTO"
if configure_case none AUTO none; then
  grep -q "missing Metal Toolchain" "$work/none.out" || fail "AUTO: the warning does not say why"
  grep -q "^FLASHATTN_WITH_METAL" "$work/none/CMakeCache.txt" && fail "FLASHATTN_WITH_METAL leaked into the cache"
  XCRUN_MODE=none cmake --build "$work/none" -j 2 --target flashattn_engines >/dev/null \
    || fail "AUTO without a Metal compiler: flashattn_engines did not build"
  [ -e "$work/none/cpp/metal" ] && fail "AUTO without a Metal compiler still configured cpp/metal"
  grep -q "FLASHATTN_NO_METAL_REASON .*missing Metal Toolchain" "$work/none/cpp/engines/generated/engines_build.h" \
    || fail "the registry is not told why metal is missing"
  [ $status -eq $before ] && echo "ok: cpu and metal-sim build; the warning and the registry say why: $(grep -o "cannot execute tool[^)]*" "$work/none.out" | head -1)"
else
  fail "AUTO without a Metal compiler: configure failed: $(tail -5 "$work/none.out")"
fi

echo "== no working Metal compiler, FLASHATTN_METAL=ON"
if configure_case none-on ON none; then
  fail "ON without a Metal compiler configured anyway"
else
  grep -q "FLASHATTN_METAL=ON" "$work/none-on.out" && echo "ok: ON fails loudly" \
    || fail "ON failed without saying why"
fi

echo "== FLASHATTN_METAL=OFF"
if configure_case off OFF full; then
  grep -q " metal " "$log" && fail "OFF still ran the Metal compiler"
  grep -q "FLASHATTN_NO_METAL_REASON .*FLASHATTN_METAL=OFF" "$work/off/cpp/engines/generated/engines_build.h" \
    || fail "OFF: the registry is not told why"
  [ $status -eq $before ] && echo "ok: OFF never probes"
else
  fail "OFF: configure failed"
fi
[ $status -eq 0 ] && echo "check_apple_build.sh: all checks passed"
exit $status
