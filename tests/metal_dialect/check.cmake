# The dialect check of a .metal file: MSL 3.1 (macOS 14; the spec: "based on
# the C++14 Specification", with restrictions) compiled as C++14 through the
# shim, strict address spaces on, -Werror (so C++17/20 features such as
# `if constexpr`, structured bindings or fold expressions fail), plus what C++14
# allows but MSL forbids and the compiler can see in the AST: lambdas.
# (Recursion, also forbidden, is not detected here: keep call graphs flat.)
# -D CLANG=... -D FILE=... -D INCLUDES="dir;..." -D EXPECT=pass|fail
set(inc)
foreach(d IN LISTS INCLUDES)
  list(APPEND inc "-I${d}")
endforeach()
set(common -x c++ -std=c++14 -fsyntax-only -Wall -Wextra -Werror -Wno-unknown-attributes
    -DFA_SIM_STRICT_ADDRESS_SPACES ${inc} ${FILE})
execute_process(COMMAND ${CLANG} ${common} RESULT_VARIABLE rc ERROR_VARIABLE err)
set(problem "")
if(NOT rc EQUAL 0)
  string(REGEX MATCH "[^\n]*error:[^\n]*" problem "${err}")
else()
  execute_process(COMMAND ${CLANG} ${common} -Xclang -ast-dump
                  RESULT_VARIABLE dump_rc OUTPUT_VARIABLE ast ERROR_VARIABLE dump_err)
  # A lambda written in a .metal file (the shim's own C++ may use them).
  string(REGEX MATCH "lambda at [^ )]*\\.metal:[0-9]+:[0-9]+" lambda "${ast}")
  if(lambda)
    set(problem "a lambda (MSL has none): ${lambda}")
  endif()
endif()
if(EXPECT STREQUAL "pass" AND problem)
  message(FATAL_ERROR "${FILE} is not MSL 3.1 (C++14-based): ${problem}\n${err}")
elseif(EXPECT STREQUAL "fail" AND NOT problem)
  message(FATAL_ERROR "the dialect check accepted ${FILE}, which Apple's compiler would reject")
elseif(problem)
  message(STATUS "rejected as expected: ${problem}")
else()
  message(STATUS "${FILE}: MSL 3.1 dialect ok")
endif()
