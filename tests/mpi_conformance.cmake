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
# A rank killed mid-exchange over the MPI transport: the job ends within 30 s
# (mpirun terminates it), naming the rank (tests/mpi/check_killed_rank.cmake).
add_executable(mpi-killed-rank ${CMAKE_CURRENT_LIST_DIR}/mpi/mpi_killed_rank.cpp)
target_link_libraries(mpi-killed-rank PRIVATE reshard_support reshard_warnings MPI::MPI_CXX)
target_include_directories(mpi-killed-rank PRIVATE ${CMAKE_CURRENT_LIST_DIR} ${CMAKE_CURRENT_LIST_DIR}/mpi)
add_test(NAME mpi.killed_rank
         COMMAND ${CMAKE_COMMAND} -DMPIEXEC=${MPIEXEC_EXECUTABLE} -DEXE=$<TARGET_FILE:mpi-killed-rank> -P ${CMAKE_CURRENT_LIST_DIR}/mpi/check_killed_rank.cmake)
set_tests_properties(mpi.killed_rank PROPERTIES TIMEOUT 120 LABELS mpi ENVIRONMENT "${RESHARD_MPI_ENV}")
# The MPI bootstrap's notice board (the out-of-band abort of reshard-refit
# --transport nccl), under mpirun -np 3.
add_executable(mpi-notice-board ${CMAKE_CURRENT_LIST_DIR}/mpi/mpi_notice_board.cpp)
target_link_libraries(mpi-notice-board PRIVATE reshard::reshard reshard_warnings MPI::MPI_CXX)
add_test(NAME mpi.notice_board COMMAND ${RESHARD_MPIRUN} ${MPIEXEC_NUMPROC_FLAG} 3 $<TARGET_FILE:mpi-notice-board>)
set_tests_properties(mpi.notice_board PROPERTIES TIMEOUT 120 LABELS mpi ENVIRONMENT "${RESHARD_MPI_ENV}")
