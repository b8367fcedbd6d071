# Runs the strict address-space check on a file with a planted address-space
# error and passes only if the strict mode rejects it with an address-space
# message while the plain mode accepts it: the strict check is what finds it.
# -D CLANG=... -D FILE=... -D INCLUDES="dir;dir;..."
set(inc)
foreach(d IN LISTS INCLUDES)
  list(APPEND inc "-I${d}")
endforeach()
set(common -x c++ -std=c++14 -fsyntax-only -Wno-unknown-attributes ${inc} ${FILE})
execute_process(COMMAND ${CLANG} -DFA_SIM_STRICT_ADDRESS_SPACES ${common}
                RESULT_VARIABLE strict_rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(strict_rc EQUAL 0)
  message(FATAL_ERROR "strict mode accepted ${FILE}: the planted address-space error went unseen")
endif()
# clang names the address space either as such or by the macro it came from.
if(NOT err MATCHES "address_space|'(device|threadgroup|constant) [a-z]")
  message(FATAL_ERROR "strict mode failed on ${FILE}, but not with an address-space error:\n${err}")
endif()
execute_process(COMMAND ${CLANG} ${common} RESULT_VARIABLE plain_rc ERROR_VARIABLE perr)
if(NOT plain_rc EQUAL 0)
  message(FATAL_ERROR "plain mode should accept ${FILE} (only address spaces are wrong):\n${perr}")
endif()
string(REGEX MATCH "[^\n]*error:[^\n]*" first_error "${err}")
message(STATUS "strict mode rejects it as expected: ${first_error}")
