# Injected faults over the UCX transport (tests/mpi/test_ucx_faults.cpp):
# forked ranks, no mpirun; built only where UCX is found.
if(NOT TARGET ucx::ucp)
  return()
endif()
if(NOT TARGET reshard_ucx)
  add_library(reshard_ucx INTERFACE)
  target_link_libraries(reshard_ucx INTERFACE reshard::reshard ucx::ucp ucx::ucs)
endif()
add_executable(test_ucx_faults ${CMAKE_CURRENT_LIST_DIR}/mpi/test_ucx_faults.cpp)
target_link_libraries(test_ucx_faults PRIVATE reshard_test_main reshard_warnings reshard_ucx)
target_include_directories(test_ucx_faults PRIVATE ${CMAKE_CURRENT_LIST_DIR})
add_test(NAME test_ucx_faults COMMAND test_ucx_faults)
set_tests_properties(test_ucx_faults PROPERTIES TIMEOUT 240 LABELS ucx ENVIRONMENT "UCX_NET_DEVICES=lo;UCX_WARN_UNUSED_ENV_VARS=n")
