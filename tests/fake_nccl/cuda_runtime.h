#pragma once
// Fake <cuda_runtime.h> for CPU tests of transport/nccl.hpp (see fake_nccl.hpp):
// the runtime calls the NCCL transport makes, over host memory, with streams
// that run their work in order inside the fake fabric.
#include "fake_nccl.hpp"
