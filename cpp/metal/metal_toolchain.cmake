# Decides whether this build has the metal engine (FLASHATTN_METAL=AUTO|ON|OFF)
# and probes Apple's Metal compiler at configure time:
#   - sets FLASHATTN_WITH_METAL (ON/OFF) and, when OFF, FLASHATTN_NO_METAL_REASON
#     (compiled into the registry: the reason fa and `python -m flashattn` give);
#   - sets FLASHATTN_METAL_PROBED_FLAGS: -fmetal-math-mode=safe and
#     -fmetal-math-fp32-functions=precise where this compiler accepts them.
# AUTO (the default) leaves metal out, with a warning saying why, when the
# compiler is missing: macOS with only the Command Line Tools, or Xcode 26+
# without its separately installed Metal Toolchain
# (`xcodebuild -downloadComponent MetalToolchain`). ON fails instead.
set(_flashattn_metal_default AUTO)
if(DEFINED ENV{FLASHATTN_METAL})
  set(_flashattn_metal_default "$ENV{FLASHATTN_METAL}")
endif()
set(FLASHATTN_METAL "${_flashattn_metal_default}" CACHE STRING
    "The metal engine: AUTO (when Apple's Metal compiler works), ON (required), OFF")
set_property(CACHE FLASHATTN_METAL PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${FLASHATTN_METAL}" _flashattn_metal_choice)
if(NOT _flashattn_metal_choice MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "FLASHATTN_METAL must be AUTO, ON or OFF, got '${FLASHATTN_METAL}'")
endif()

set(FLASHATTN_WITH_METAL OFF)
set(FLASHATTN_NO_METAL_REASON "")
set(FLASHATTN_METAL_PROBED_FLAGS "")

function(_flashattn_metal_compiles out_ok out_error)  # ARGN: extra flags
  set(_dir ${CMAKE_BINARY_DIR}/flashattn_metal_probe)
  file(MAKE_DIRECTORY ${_dir})
  file(WRITE ${_dir}/probe.metal
       "#include <metal_stdlib>\nkernel void probe(device float* x [[buffer(0)]]) { x[0] = 1.0f; }\n")
  execute_process(
    COMMAND xcrun -sdk macosx metal ${ARGN} -c ${_dir}/probe.metal -o ${_dir}/probe.air
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  if(_rc EQUAL 0)
    set(${out_ok} TRUE PARENT_SCOPE)
    set(${out_error} "" PARENT_SCOPE)
  else()
    string(STRIP "${_err}${_out}" _msg)
    string(REGEX REPLACE "\n.*" "" _msg "${_msg}")  # its first line
    string(REPLACE "\"" "'" _msg "${_msg}")
    set(${out_ok} FALSE PARENT_SCOPE)
    set(${out_error} "${_msg} (exit ${_rc})" PARENT_SCOPE)
  endif()
endfunction()

if(NOT APPLE)
  set(FLASHATTN_NO_METAL_REASON "not built: the metal engine needs macOS 14+ on Apple silicon")
  if(_flashattn_metal_choice STREQUAL "ON")
    message(FATAL_ERROR "FLASHATTN_METAL=ON, but the metal engine builds only on macOS")
  endif()
elseif(_flashattn_metal_choice STREQUAL "OFF")
  set(FLASHATTN_NO_METAL_REASON "not built: FLASHATTN_METAL=OFF")
else()
  _flashattn_metal_compiles(_ok _error -Werror -std=metal3.1)
  if(_ok)
    set(FLASHATTN_WITH_METAL ON)
    # Safe math where the compiler knows the flags (newer Xcode); -fno-fast-math stays regardless.
    foreach(_flag -fmetal-math-mode=safe -fmetal-math-fp32-functions=precise)
      _flashattn_metal_compiles(_flag_ok _flag_error -Werror -std=metal3.1 ${_flag})
      if(_flag_ok)
        list(APPEND FLASHATTN_METAL_PROBED_FLAGS ${_flag})
      endif()
    endforeach()
    message(STATUS "flashattn: metal engine ON (Metal compiler flags probed: "
                   "${FLASHATTN_METAL_PROBED_FLAGS})")
  else()
    set(FLASHATTN_NO_METAL_REASON
        "not built: Apple's Metal compiler did not work at build time (xcrun -sdk macosx metal: ${_error}). It needs full Xcode, and on Xcode 26+ also its Metal Toolchain: xcodebuild -downloadComponent MetalToolchain; then reinstall")
    if(_flashattn_metal_choice STREQUAL "ON")
      message(FATAL_ERROR "flashattn: FLASHATTN_METAL=ON, but ${FLASHATTN_NO_METAL_REASON}")
    endif()
    message(WARNING "flashattn: building the cpu and metal-sim engines only; metal ${FLASHATTN_NO_METAL_REASON}")
  endif()
endif()
