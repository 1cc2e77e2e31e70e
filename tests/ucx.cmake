# The UCX transport's tests (tests/mpi/), built only where UCX is found.
#   (test_ucx_fork and the other forked-rank tests: tests/ucx_forked.cmake)
#   ucx.mpi.refit       under mpirun -np 8: layout pairs (colocated, flat
#                       buckets, permuted ranks, a small MoE preset, random
#                       uneven/fused pairs) refitted over UCX with both
#                       protocols, validated element by element
#   ucx.mpi.cli         under mpirun -np 6: `reshard-refit --transport ucx`
#                       (tiny MoE tp=2,dp=1,ep=2 -> tp=4), must validate
#   ucx.mpi.cli.delta   the same with --delta (tiny-llama tp=2 -> tp=4, 4
#                       Adam versions, every one checked against the dense refit)
# Loopback only: UCX_NET_DEVICES=lo; shared memory + CMA carry the data, TCP
# the error-handling control endpoints. mpirun runs as root in CI containers,
# oversubscribed (2 cores).
if(NOT TARGET ucx::ucp)  # found (or not) by the top-level CMakeLists.txt
  message(STATUS "reshard: UCX not found (libucx-dev): the UCX transport's tests are skipped")
  return()
endif()

set(_ucx_env "UCX_NET_DEVICES=lo" "UCX_WARN_UNUSED_ENV_VARS=n")

if(NOT RESHARD_MPIRUN)
  message(STATUS "reshard: MPI not found: the UCX tests under mpirun are skipped")
  return()
endif()

add_executable(ucx-mpi-refit ${CMAKE_CURRENT_LIST_DIR}/mpi/ucx_mpi_refit.cpp)
target_link_libraries(ucx-mpi-refit PRIVATE reshard_warnings reshard_support reshard_ucx MPI::MPI_CXX)
target_include_directories(ucx-mpi-refit PRIVATE ${CMAKE_CURRENT_LIST_DIR})
target_compile_definitions(ucx-mpi-refit PRIVATE RESHARD_SOURCE_DIR="${PROJECT_SOURCE_DIR}")

# No MPI-level UCX (MPI only bootstraps); the ranks get the UCX settings.
set(_mpirun ${RESHARD_MPIRUN} -x UCX_NET_DEVICES -x UCX_WARN_UNUSED_ENV_VARS)
set(_mpi_env ${_ucx_env} ${RESHARD_MPI_ENV})

add_test(NAME ucx.mpi.refit COMMAND ${_mpirun} ${MPIEXEC_NUMPROC_FLAG} 8 $<TARGET_FILE:ucx-mpi-refit>)
set_tests_properties(ucx.mpi.refit PROPERTIES TIMEOUT 240 LABELS "ucx;mpi" ENVIRONMENT "${_mpi_env}")

if(TARGET reshard-refit)
  add_test(NAME ucx.mpi.cli
           COMMAND ${_mpirun} ${MPIEXEC_NUMPROC_FLAG} 6 $<TARGET_FILE:reshard-refit> --transport ucx --model ${PROJECT_SOURCE_DIR}/examples/models/tiny-moe.json
                   --train tp=2,dp=1,ep=2 --infer tp=4 --iterations 3 --json)
  set_tests_properties(ucx.mpi.cli PROPERTIES TIMEOUT 240 LABELS "ucx;mpi" ENVIRONMENT "${_mpi_env}")
  add_test(NAME ucx.mpi.cli.delta
           COMMAND ${_mpirun} ${MPIEXEC_NUMPROC_FLAG} 6 $<TARGET_FILE:reshard-refit> --transport ucx --model ${PROJECT_SOURCE_DIR}/examples/models/tiny-llama.json
                   --train tp=2 --infer tp=4 --delta --versions 4 --json)
  set_tests_properties(ucx.mpi.cli.delta PROPERTIES TIMEOUT 240 LABELS "ucx;mpi" ENVIRONMENT "${_mpi_env}")
  # The staged (hierarchical) plan over UCX: every rollout rank needs the
  # whole model, so the plan crosses the network once per NVLink domain and
  # fans out inside it (stages > 1), every element validated.
  add_test(NAME ucx.mpi.cli.hierarchical
           COMMAND ${_mpirun} ${MPIEXEC_NUMPROC_FLAG} 6 $<TARGET_FILE:reshard-refit> --transport ucx --model ${PROJECT_SOURCE_DIR}/examples/models/tiny-llama.json
                   --train tp=2 --infer tp=1,dp=4 --hierarchical --topology ${PROJECT_SOURCE_DIR}/tests/topology/four-gpu-domains.json
                   --iterations 2 --no-baseline --json)
  set_tests_properties(ucx.mpi.cli.hierarchical PROPERTIES TIMEOUT 240 LABELS "ucx;mpi" ENVIRONMENT "${_mpi_env}"
                       PASS_REGULAR_EXPRESSION "\"hierarchical\":true.*\"stages\":[2-9].*\"validated\":true")
endif()
