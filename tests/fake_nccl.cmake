# test_nccl_fake.cpp builds transport/nccl.hpp on any machine against the
# fake NCCL and CUDA runtime in tests/fake_nccl/ (their <nccl.h> and
# <cuda_runtime.h> come first on its include path; it links neither).
if(TARGET test_nccl_fake)
  target_include_directories(test_nccl_fake BEFORE PRIVATE ${CMAKE_CURRENT_LIST_DIR}/fake_nccl)
endif()
