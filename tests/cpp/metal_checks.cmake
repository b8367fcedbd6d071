# Checks of the .metal sources that need no Mac (see metal-checks.md):
#  - plain mode: every shaders/*.metal compiled as C++ through metal-sim's
#    <metal_stdlib> with -Wall -Wextra -Werror (the build's compiler, and clang);
#  - strict mode (clang): device / constant / threadgroup as distinct clang
#    address spaces, so mixing them is a compile error as with Apple's
#    compiler; two planted mistakes prove the strict mode rejects them;
#  - dialect (clang, tests/metal_dialect/check.cmake): C++14, the base of
#    MSL 3.1, and no lambdas; planted C++17 and lambda files prove it rejects.
file(GLOB _metal_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/shaders/*.metal)
set(_metal_includes ${PROJECT_SOURCE_DIR}/cpp/sim/shim ${PROJECT_SOURCE_DIR}/shaders ${PROJECT_SOURCE_DIR}/cpp)
set(_metal_inc_flags)
foreach(d IN LISTS _metal_includes)
  list(APPEND _metal_inc_flags -I${d})
endforeach()
# C++14: the dialect MSL 3.1 (macOS 14) is based on, so newer C++ fails here
# as it would in Apple's compiler.
set(_metal_common -x c++ -std=c++14 -fsyntax-only -Wall -Wextra -Werror)

if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  set(FLASHATTN_CLANGXX ${CMAKE_CXX_COMPILER} CACHE FILEPATH "clang++ for the strict .metal checks")
else()
  # Newest first: the metal-sim shim's half is _Float16, which clang has on
  # x86-64 only from clang 15 (Debian 12's plain clang++ is clang 14).
  find_program(FLASHATTN_CLANGXX NAMES clang++-19 clang++-18 clang++-17 clang++-16 clang++-15
                                       clang++)
endif()

foreach(src IN LISTS _metal_sources)
  get_filename_component(name ${src} NAME_WE)
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    set(_noattr -Wno-unknown-attributes)
  else()
    set(_noattr -Wno-attributes)
  endif()
  add_test(NAME metal_plain_${name}
           COMMAND ${CMAKE_CXX_COMPILER} ${_metal_common} ${_noattr} ${_metal_inc_flags} ${src})
  if(FLASHATTN_CLANGXX)
    add_test(NAME metal_strict_${name}
             COMMAND ${FLASHATTN_CLANGXX} ${_metal_common} -Wno-unknown-attributes
                     -DFA_SIM_STRICT_ADDRESS_SPACES ${_metal_inc_flags} ${src})
    if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
      add_test(NAME metal_plain_clang_${name}
               COMMAND ${FLASHATTN_CLANGXX} ${_metal_common} -Wno-unknown-attributes
                       ${_metal_inc_flags} ${src})
    endif()
  endif()
endforeach()

if(FLASHATTN_CLANGXX)
  foreach(src IN LISTS _metal_sources)
    get_filename_component(name ${src} NAME_WE)
    add_test(NAME metal_dialect_${name}
             COMMAND ${CMAKE_COMMAND} -DCLANG=${FLASHATTN_CLANGXX} -DFILE=${src} -DEXPECT=pass
                     "-DINCLUDES=${_metal_includes}"
                     -P ${PROJECT_SOURCE_DIR}/tests/metal_dialect/check.cmake)
  endforeach()
  file(GLOB _dialect_planted ${PROJECT_SOURCE_DIR}/tests/metal_dialect/rejects_*.metal)
  foreach(src IN LISTS _dialect_planted)
    get_filename_component(name ${src} NAME_WE)
    add_test(NAME metal_dialect_${name}
             COMMAND ${CMAKE_COMMAND} -DCLANG=${FLASHATTN_CLANGXX} -DFILE=${src} -DEXPECT=fail
                     "-DINCLUDES=${_metal_includes}"
                     -P ${PROJECT_SOURCE_DIR}/tests/metal_dialect/check.cmake)
  endforeach()
  # The in-stream paths' generated texts (issue 35), strict, in MSL's dialect.
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    add_test(NAME instream_texts_strict
             COMMAND ${CMAKE_COMMAND} -DPYTHON=${Python3_EXECUTABLE} -DCLANG=${FLASHATTN_CLANGXX}
                     -DSOURCE=${PROJECT_SOURCE_DIR} -DOUT=${CMAKE_CURRENT_BINARY_DIR}/instream_strict
                     -P ${PROJECT_SOURCE_DIR}/tests/cpp/instream_strict.cmake)
  endif()
  file(GLOB _planted ${PROJECT_SOURCE_DIR}/tests/metal_negative/*.metal)
  foreach(src IN LISTS _planted)
    get_filename_component(name ${src} NAME_WE)
    add_test(NAME metal_strict_rejects_${name}
             COMMAND ${CMAKE_COMMAND} -DCLANG=${FLASHATTN_CLANGXX} -DFILE=${src}
                     "-DINCLUDES=${_metal_includes}"
                     -P ${PROJECT_SOURCE_DIR}/tests/metal_negative/expect_strict_error.cmake)
  endforeach()
elseif(DEFINED ENV{CI})
  # CI installs clang (.ci/run): there, a missing clang is a failure.
  message(FATAL_ERROR "no clang++ found: the strict address-space checks of the .metal "
                      "sources need clang (apt-get install clang)")
else()
  # Not a silent pass: without clang the strict check cannot run; ctest lists
  # it as skipped, with this reason in its output.
  add_test(NAME metal_strict_needs_clang
           COMMAND sh -c "echo 'no clang++ found: strict address-space checks of the .metal sources not run; install clang to run them'; exit 77")
  set_tests_properties(metal_strict_needs_clang PROPERTIES SKIP_RETURN_CODE 77)
endif()

# The sanitizer runs of metal-sim (test_sim_kernels: every kernel; and
# test_sim_launcher) are the `sanitize`-labelled ctest runs of the
# ThreadSanitizer and AddressSanitizer+UBSan builds made by tests/sanitize.sh.
