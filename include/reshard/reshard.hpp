#pragma once
// Umbrella header. Data flows one way:
//   layouts (types or JSON) -> plan -> schedule -> executor over a transport.
// Left out because they need more than a C++ compiler: backends/ucx.hpp
// (UCX), backends/nccl.hpp (CUDA runtime + NCCL headers), cuda/*.cuh (nvcc).

// Layouts
#include "reshard/dtype.hpp"
#include "reshard/error.hpp"
#include "reshard/mesh.hpp"
#include "reshard/dim_spec.hpp"
#include "reshard/layout.hpp"
#include "reshard/storage.hpp"
#include "reshard/static_layout.hpp"
#include "reshard/json_io.hpp"
#include "reshard/presets/presets.hpp"

// Plan
#include "reshard/box.hpp"
#include "reshard/schedule.hpp"
#include "reshard/plan.hpp"
#include "reshard/message_rule.hpp"
#include "reshard/topology.hpp"
#include "reshard/hierarchical.hpp"
#include "reshard/staged_executor.hpp"
#include "reshard/simulate.hpp"
#include "reshard/stream_traffic.hpp"

// Execution
#include "reshard/transport.hpp"
#include "reshard/copy_kernels.hpp"
#include "reshard/checksum.hpp"
#include "reshard/cuda/box_batch.hpp"
#include "reshard/cuda/device_engine.hpp"
#include "reshard/executor.hpp"
#include "reshard/resharder.hpp"
#include "reshard/backends/local.hpp"
#include "reshard/backends/fault_injection.hpp"
#include "reshard/traditional.hpp"
#include "reshard/verify.hpp"
