# Checks of the .metal sources that need no Mac (see metal-checks.md):
#  - plain mode: every shaders/*.metal compiled as C++ through metal-sim's
#    <metal_stdlib> with -Wall -Wextra -Werror (the build's compiler, and clang);
#  - strict mode (clang): device / constant / threadgroup as distinct clang
#    address spaces, so mixing them is a compile error as with Apple's
#    compiler; two planted mistakes prove the strict mode rejects them;
#  - metal-sim built with ThreadSanitizer and with AddressSanitizer+UBSan,
#    running a few cases of every kernel (label "sanitize").
file(GLOB _metal_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/shaders/*.metal)
set(_metal_includes ${PROJECT_SOURCE_DIR}/cpp/sim/shim ${PROJECT_SOURCE_DIR}/shaders ${PROJECT_SOURCE_DIR}/cpp)
set(_metal_inc_flags)
foreach(d IN LISTS _metal_includes)
  list(APPEND _metal_inc_flags -I${d})
endforeach()
set(_metal_common -x c++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror)

if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  set(FLASHATTN_CLANGXX ${CMAKE_CXX_COMPILER} CACHE FILEPATH "clang++ for the strict .metal checks")
else()
  find_program(FLASHATTN_CLANGXX NAMES clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15)
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
  file(GLOB _planted ${PROJECT_SOURCE_DIR}/tests/metal_negative/*.metal)
  foreach(src IN LISTS _planted)
    get_filename_component(name ${src} NAME_WE)
    add_test(NAME metal_strict_rejects_${name}
             COMMAND ${CMAKE_COMMAND} -DCLANG=${FLASHATTN_CLANGXX} -DFILE=${src}
                     "-DINCLUDES=${_metal_includes}"
                     -P ${PROJECT_SOURCE_DIR}/tests/metal_negative/expect_strict_error.cmake)
  endforeach()
else()
  # Not a silent pass: without clang the strict check cannot run, and says so.
  add_test(NAME metal_strict_needs_clang
           COMMAND ${CMAKE_COMMAND} -E echo "no clang++ found: strict address-space checks not run")
  set_tests_properties(metal_strict_needs_clang PROPERTIES WILL_FAIL TRUE)
endif()

# The sanitizer builds: this same source tree configured again with
# FLASHATTN_SANITIZE, building only the sim kernel test. Not inside a
# sanitizer build itself (no recursion).
if(NOT FLASHATTN_SANITIZE)
  foreach(kind thread address)
    if(kind STREQUAL "thread")
      set(_flags thread)
      set(_env "TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1")
    else()
      set(_flags "address,undefined")
      set(_env "ASAN_OPTIONS=detect_leaks=1:abort_on_error=0;UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1")
    endif()
    set(_dir ${CMAKE_BINARY_DIR}/sanitize-${kind})
    add_test(NAME sim_sanitize_${kind}
             COMMAND ${CMAKE_CTEST_COMMAND}
                     --build-and-test ${PROJECT_SOURCE_DIR} ${_dir}
                     --build-generator ${CMAKE_GENERATOR}
                     --build-target test_sim_kernels
                     --build-noclean
                     --build-options -DFLASHATTN_BUILD_TESTS=ON -DFLASHATTN_BUILD_PYTHON=OFF
                                     -DFLASHATTN_NATIVE=OFF -DFLASHATTN_SANITIZE=${_flags}
                                     -DCMAKE_BUILD_TYPE=RelWithDebInfo
                                     -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}
                     --test-command ${_dir}/tests/cpp/test_sim_kernels --quick)
    set_tests_properties(sim_sanitize_${kind} PROPERTIES LABELS sanitize TIMEOUT 1200
                         ENVIRONMENT "${_env}")
  endforeach()
endif()
