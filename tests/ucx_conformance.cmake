# The transport conformance suite over UCX (tests/mpi/test_ucx_conformance.cpp):
# forked ranks, no mpirun, both protocols; built only where UCX is found.
if(NOT TARGET ucx::ucp)
  return()
endif()
if(NOT TARGET reshard_ucx)
  add_library(reshard_ucx INTERFACE)
  target_link_libraries(reshard_ucx INTERFACE reshard::reshard ucx::ucp ucx::ucs)
endif()
add_executable(test_ucx_conformance ${CMAKE_CURRENT_LIST_DIR}/mpi/test_ucx_conformance.cpp)
target_link_libraries(test_ucx_conformance PRIVATE reshard_test_main reshard_warnings reshard_ucx)
target_include_directories(test_ucx_conformance PRIVATE ${CMAKE_CURRENT_LIST_DIR} ${CMAKE_CURRENT_LIST_DIR}/mpi)
add_test(NAME test_ucx_conformance COMMAND test_ucx_conformance)
set_tests_properties(test_ucx_conformance PROPERTIES TIMEOUT 240 LABELS ucx ENVIRONMENT "UCX_NET_DEVICES=lo;UCX_WARN_UNUSED_ENV_VARS=n")
