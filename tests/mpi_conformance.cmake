# The transport conformance suite over mpi_transport.hpp (MPI_Isend /
# MPI_Irecv, written from transport.hpp alone), under mpirun -np 3.
if(NOT RESHARD_MPIRUN)
  message(STATUS "reshard: MPI not found: the MPI transport's conformance run is skipped")
  return()
endif()
add_executable(mpi-transport-conformance ${CMAKE_CURRENT_LIST_DIR}/mpi/mpi_conformance.cpp)
target_link_libraries(mpi-transport-conformance PRIVATE reshard_support reshard_warnings doctest::doctest MPI::MPI_CXX)
target_include_directories(mpi-transport-conformance PRIVATE ${CMAKE_CURRENT_LIST_DIR} ${CMAKE_CURRENT_LIST_DIR}/mpi)
add_test(NAME mpi.transport_conformance COMMAND ${RESHARD_MPIRUN} ${MPIEXEC_NUMPROC_FLAG} 3 $<TARGET_FILE:mpi-transport-conformance>)
set_tests_properties(mpi.transport_conformance PROPERTIES TIMEOUT 120 LABELS mpi ENVIRONMENT "${RESHARD_MPI_ENV}")
