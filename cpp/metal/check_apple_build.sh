#!/usr/bin/env bash
# Exercises the APPLE half of the CMake build on Linux: configures the project
# for arm64 macOS 14 (clang-16 with the macOS SDK headers as sysroot, a
# stand-in `xcrun` that records the Metal compiler commands instead of running
# them), builds every static library including flashattn_metal (.mm files as
# Objective-C++ with ARC), and checks that
#   - each shaders/*.metal is compiled with -fno-fast-math and the same
#     minimum macOS as the extension, and linked into one flashattn.metallib;
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
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
cat > "$work/bin/xcrun" <<EOF
#!/usr/bin/env bash
echo "xcrun \$*" >> "$work/xcrun.log"
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
  for flag in -fno-fast-math -mmacosx-version-min=14.0 -Wall -Wextra; do
    case " $line " in *" $flag "*) ;; *) fail "$(basename "$shader") compiled without $flag";; esac
  done
done
grep -q "metallib .* -o $build/cpp/metal/flashattn.metallib" "$log" || fail "no flashattn.metallib link step"
echo "ok: $(grep -c ' metal ' "$log") shader(s) compiled, linked into flashattn.metallib"

: > "$log"
touch "$repo/shaders/flash_params.h"
cmake --build "$build" --target flashattn_metallib >/dev/null
n_shaders=$(ls "$repo"/shaders/*.metal | wc -l)
[ "$(grep -c ' metal ' "$log")" -eq "$n_shaders" ] || fail "a shared header change did not recompile every shader"
echo "ok: a change to shaders/flash_params.h recompiles all $n_shaders shader(s)"

# Foundation re-exports CoreFoundation (where NSURL lives).
frameworks="$sdk/System/Library/Frameworks"
tbds=("$frameworks/Metal.framework/Metal.tbd" "$frameworks/Foundation.framework/Foundation.tbd"
      "$frameworks/CoreFoundation.framework/CoreFoundation.tbd")
missing=0
while read -r sym; do
  case "$sym" in
    _OBJC_CLASS_\$_*) pattern="(^|[^A-Za-z0-9_])${sym#_OBJC_CLASS_\$_}([^A-Za-z0-9_]|$)" ;;  # listed by class name
    *) pattern="(^|[^A-Za-z0-9_])${sym}([^A-Za-z0-9_]|$)" ;;                              # C symbols keep their _
  esac
  if ! grep -qE -- "$pattern" "${tbds[@]}"; then
    fail "symbol $sym is not exported by Metal or Foundation"; missing=1
  fi
done < <(llvm-nm-16 -u "$build/cpp/metal/libflashattn_metal.a" | grep -E '^_(OBJC_CLASS_\$_)?(MTL|NS)' | sort -u)
[ $missing -eq 0 ] && echo "ok: every MTL*/NS* symbol of flashattn_metal is exported by the SDK's Metal/Foundation .tbd"
[ $status -eq 0 ] && echo "check_apple_build.sh: all checks passed"
exit $status
