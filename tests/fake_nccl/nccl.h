#pragma once
// Fake <nccl.h> for CPU tests of transport/nccl.hpp (see fake_nccl.hpp).
#include "fake_nccl.hpp"
