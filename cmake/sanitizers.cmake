# Sanitizer builds: -DRESHARD_SANITIZE=address,undefined (ASan + UBSan) or
# -DRESHARD_SANITIZE=thread (TSan). Included by the top-level CMakeLists.txt.
#
# The flags go into CMAKE_CXX_FLAGS and the linker flags, which CMake reads
# when it generates the build, so they reach every target of the project
# (tests, tools, benchmarks, fuzzers), also those defined before this file is
# included. UBSan does not recover: a finding aborts the program, so the test
# that hit it fails instead of printing a warning nobody reads.
set(RESHARD_SANITIZE "" CACHE STRING
    "Sanitizers for everything reshard builds: address,undefined | thread | undefined | empty for none")
set(RESHARD_SANITIZE_OPT "-Og" CACHE STRING
    "Optimization of sanitizer builds (-Og: fast to compile; the long fuzzing runs use -O2)")

if(RESHARD_SANITIZE)
  string(REPLACE "," ";" _reshard_san_list "${RESHARD_SANITIZE}")
  foreach(s ${_reshard_san_list})
    if(NOT s MATCHES "^(address|undefined|thread|leak)$")
      message(FATAL_ERROR "RESHARD_SANITIZE: unknown sanitizer '${s}' (use address,undefined or thread)")
    endif()
  endforeach()
  if("thread" IN_LIST _reshard_san_list AND ("address" IN_LIST _reshard_san_list OR "leak" IN_LIST _reshard_san_list))
    message(FATAL_ERROR "RESHARD_SANITIZE: thread cannot be combined with address or leak")
  endif()
  string(REPLACE ";" "," _reshard_san "${_reshard_san_list}")
  # -Og keeps the programs fast enough for the test time limits while the
  # sanitizers still see every access, and compiles in under half the time
  # of -O1 (g++ 12, ASan+UBSan: 46 s vs 110 s for one test source); -g1
  # (line tables) is all a sanitizer's stack trace needs. Frame pointers
  # give whole stacks.
  set(_reshard_san_flags "-fsanitize=${_reshard_san} -fno-omit-frame-pointer -g1 ${RESHARD_SANITIZE_OPT}")
  if("undefined" IN_LIST _reshard_san_list)
    string(APPEND _reshard_san_flags " -fno-sanitize-recover=undefined")
  endif()
  string(APPEND CMAKE_CXX_FLAGS " ${_reshard_san_flags}")
  string(APPEND CMAKE_C_FLAGS " ${_reshard_san_flags}")
  string(APPEND CMAKE_EXE_LINKER_FLAGS " -fsanitize=${_reshard_san}")
  string(APPEND CMAKE_SHARED_LINKER_FLAGS " -fsanitize=${_reshard_san}")
  # The build type's -O2/-O3 would come after ours: drop them for this build.
  foreach(cfg RELEASE RELWITHDEBINFO MINSIZEREL)
    string(REGEX REPLACE "-O[0-9s]" "" CMAKE_CXX_FLAGS_${cfg} "${CMAKE_CXX_FLAGS_${cfg}}")
  endforeach()
  message(STATUS "reshard: sanitizers ${_reshard_san} for every target (${_reshard_san_flags})")
endif()
