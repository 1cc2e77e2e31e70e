# cmake -DMPIEXEC=... -DEXE=... -P check_killed_rank.cmake: runs EXE (tests/mpi/mpi_killed_rank.cpp)
# on 3 ranks, rank 1 SIGKILLs itself mid-exchange while the others wait with a
# 300 s deadline. Passes when the job ends non-zero within 30 s and the
# launcher's report names rank 1 as killed. (Open MPI 4.1 has no fault
# tolerance: the bound comes from mpirun terminating the job, not from the
# transport naming the dead peer.)
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${MPIEXEC} --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl self,vader,tcp --mca btl_tcp_if_include lo
                        --mca oob_tcp_if_include lo -np 3 ${EXE}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 90)
string(TIMESTAMP t1 "%s")
math(EXPR seconds "${t1} - ${t0}")
message(STATUS "the job ended after ${seconds} s with ${rc}:\n${out}")
if(rc EQUAL 0)
  message(FATAL_ERROR "the job with a killed rank exited 0")
endif()
if(seconds GREATER_EQUAL 30)
  message(FATAL_ERROR "the job with a killed rank ended only after ${seconds} s (bound: 30 s)")
endif()
if(NOT out MATCHES "process rank 1 .*signal 9")
  message(FATAL_ERROR "the launcher's report does not name rank 1 as killed")
endif()
