# The in-stream paths' generated kernel texts (python/flashattn/_instream),
# each as MLX's metal_kernel or torch's compile_shader would compile it with
# its function constants as constexpr values, checked by clang in metal-sim's
# strict address-space mode in MSL's dialect (C++14): a text that binds a
# device buffer where the kernel reads `constant` memory, or any other
# mistake Apple's compiler would reject there, fails here.
# cmake -DPYTHON=.. -DCLANG=.. -DSOURCE=<repo> -DOUT=<dir> -P instream_strict.cmake
execute_process(
  COMMAND ${PYTHON} ${SOURCE}/cpp/sim/generate_instream.py --strict ${SOURCE}/shaders ${OUT}
  RESULT_VARIABLE generated)
if(NOT generated EQUAL 0)
  message(FATAL_ERROR "generating the in-stream texts failed")
endif()
file(GLOB parts ${OUT}/instream_strict_*.cpp)
if(NOT parts)
  message(FATAL_ERROR "no texts generated in ${OUT}")
endif()
foreach(part IN LISTS parts)
  execute_process(
    COMMAND ${CLANG} -x c++ -std=c++14 -fsyntax-only -Wall -Wextra -Werror -Wno-unknown-attributes
            -DFA_SIM_STRICT_ADDRESS_SPACES -I${SOURCE}/cpp/sim/shim -I${SOURCE}/shaders
            -I${SOURCE}/cpp ${part}
    RESULT_VARIABLE failed OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(failed)
    message(FATAL_ERROR "${part}: the strict check failed:\n${out}")
  endif()
  message(STATUS "${part}: passed")
endforeach()
