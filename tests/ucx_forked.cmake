# UCX tests over forked ranks (no mpirun), built only where UCX is found:
#   test_ucx_fork          transport semantics, error messages, killed and stopped peers
#   test_ucx_faults        injected faults over the UCX transport
#   test_ucx_conformance   the transport conformance suite, both protocols
if(NOT TARGET ucx::ucp)
  return()
endif()
foreach(name test_ucx_fork test_ucx_faults test_ucx_conformance)
  add_executable(${name} ${CMAKE_CURRENT_LIST_DIR}/mpi/${name}.cpp)
  target_link_libraries(${name} PRIVATE reshard_test_main reshard_warnings reshard_ucx)
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_LIST_DIR} ${CMAKE_CURRENT_LIST_DIR}/mpi)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES TIMEOUT 240 LABELS ucx ENVIRONMENT "UCX_NET_DEVICES=lo;UCX_WARN_UNUSED_ENV_VARS=n")
endforeach()
