# ggml compiles its AMX matmul kernels in whenever the compiler targets AMX
# (GGML_NATIVE on an AMX-capable x86 CPU). In the pinned upstream those
# kernels execute tile instructions on worker threads that never loaded a tile
# configuration, which faults (SIGILL in tinygemm_kernel_amx, seen on Q8_0 and
# Q4_K models on Xeon machines with AMX), so stock llama.cpp crashes there.
# AMX stays off unless asked for with -DPYSPICE_AMX=ON.
option(PYSPICE_AMX "Build ggml's AMX kernels (crash-prone in the pinned upstream)" OFF)

function(pyspice_configure_amx target)
    if(PYSPICE_AMX OR NOT CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
        return()
    endif()
    include(CheckCCompilerFlag)
    check_c_compiler_flag(-mno-amx-int8 PYSPICE_HAS_MNO_AMX)
    if(PYSPICE_HAS_MNO_AMX)
        target_compile_options(${target} PRIVATE -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
    endif()
endfunction()
