# The GPU resource gate (docs/gpu-gate.md), included by tests/cpp/CMakeLists.txt:
#  - gpu_gate_kernels: every kernel of the metallib (metal-sim's table, each
#    with the plan's threadgroup sizes) compiled through the proxy
#    <metal_stdlib> for amdgcn gfx1100 and nvptx by clang-19; fails if one
#    uses scratch / local memory or more than 128 VGPRs; prints the table.
#    Until the tiled kernels land it runs with --expect-over-budget (passes
#    while some kernel is over budget, prints the table either way); with
#    -DFLASHATTN_GPU_GATE_STRICT=ON it requires every kernel to pass.
#  - gpu_gate_planted: planted kernels with known verdicts (one in registers,
#    opaque, folded and with its function constant unset; one of half and
#    bfloat fragments and every SIMD function; one in scratch; one
#    over 128 VGPRs), so the gate is known to be able to fail and to pass.
# Not in sanitizer builds: it compiles for GPUs, the sanitizers change nothing.
option(FLASHATTN_GPU_GATE_STRICT "Require every Metal kernel to pass the GPU resource gate" ON)
if(NOT FLASHATTN_SANITIZE)
  set(_gate_dir ${PROJECT_SOURCE_DIR}/tests/gpu_gate)
  # clang 19 with the AMDGPU and NVPTX back ends: Debian's clang-19, or
  # Homebrew's llvm@19 on a Mac (Apple's clang has neither back end).
  find_program(FLASHATTN_GPU_GATE_CLANG NAMES clang++-19 clang++
               PATHS /opt/homebrew/opt/llvm@19/bin /usr/local/opt/llvm@19/bin NO_DEFAULT_PATH
               DOC "clang 19 with the AMDGPU and NVPTX back ends, for the GPU resource gate")
  find_program(FLASHATTN_GPU_GATE_CLANG NAMES clang++-19)
  find_package(Python3 COMPONENTS Interpreter)
  if(FLASHATTN_GPU_GATE_CLANG AND Python3_Interpreter_FOUND)
    add_executable(gpu_gate_plan_launches ${_gate_dir}/plan_launches.cpp)
    target_link_libraries(gpu_gate_plan_launches PRIVATE flashattn_core)
    set(_gate ${Python3_EXECUTABLE} ${_gate_dir}/gate.py --clang ${FLASHATTN_GPU_GATE_CLANG}
              --root ${PROJECT_SOURCE_DIR})
    if(FLASHATTN_GPU_GATE_STRICT)
      set(_gate_mode)
    else()
      set(_gate_mode --expect-over-budget)
    endif()
    add_test(NAME gpu_gate_kernels
             COMMAND ${_gate} --work ${CMAKE_CURRENT_BINARY_DIR}/gpu_gate/kernels
                     --plan-launches $<TARGET_FILE:gpu_gate_plan_launches> ${_gate_mode})
    add_test(NAME gpu_gate_planted
             COMMAND ${_gate} --work ${CMAKE_CURRENT_BINARY_DIR}/gpu_gate/planted
                     --source ${_gate_dir}/planted/planted.metal
                     --kernel planted_tiles=planted_tiles@128:pass
                     --kernel planted_tiles_folded=planted_tiles@128/0=1:pass
                     --kernel planted_tiles_unset=planted_tiles@128/:unset-constant
                     --kernel planted_types=planted_types@64:pass
                     --kernel planted_scratch=planted_scratch@64:scratch
                     --kernel planted_vgprs=planted_vgprs@64:scratch)
    set_tests_properties(gpu_gate_kernels gpu_gate_planted PROPERTIES LABELS gpu_gate)
    # Every kernel through two GPU back ends: about 6 minutes on 2 cores, so
    # `slow`: tests/run.sh leaves it to --all (CI).
    set_tests_properties(gpu_gate_kernels PROPERTIES LABELS "gpu_gate;slow")
  elseif(DEFINED ENV{CI} AND NOT APPLE)
    # Linux CI installs clang-19 (.ci/run): there, a missing one is a failure.
    message(FATAL_ERROR "the GPU resource gate needs clang++-19 and a Python 3 interpreter "
                        "(apt-get install clang-19); found clang: '${FLASHATTN_GPU_GATE_CLANG}', "
                        "python: '${Python3_EXECUTABLE}'")
  else()
    # Not a silent pass: ctest lists it as skipped, with this reason.
    add_test(NAME gpu_gate_needs_clang19
             COMMAND sh -c "echo 'no clang++-19 (or no Python 3) found: the GPU resource gate was not run; apt-get install clang-19 to run it'; exit 77")
    set_tests_properties(gpu_gate_needs_clang19 PROPERTIES SKIP_RETURN_CODE 77)
  endif()
endif()
