#pragma once
// The core, in one include. Data flows one way:
//   layouts (types or JSON) -> plan -> schedule -> executor over a transport.
// Beside the core, each its own include and CMake target:
//   reshard/presets/presets.hpp   HF config -> Megatron / vLLM layouts   (reshard::presets)
//   reshard/backends/ucx.hpp      the UCX transport                       (reshard::ucx)
//   reshard/backends/nccl.hpp     the NCCL transport                      (reshard::nccl)
//   reshard/cuda/*                CUDA copy kernels and device engine     (reshard::cuda)
//   reshard/sim/simulate.hpp, stream_traffic.hpp   the refit simulator    (reshard::sim)
//   support/reshard_support/ (verify, traditional, fault_injection, ucx_refit): test and tool
//                                 support of this repository, not installed

// Layouts
#include "reshard/dtype.hpp"
#include "reshard/error.hpp"
#include "reshard/mesh.hpp"
#include "reshard/dim_spec.hpp"
#include "reshard/layout.hpp"
#include "reshard/storage.hpp"
#include "reshard/rank_buffers.hpp"
#include "reshard/static_layout.hpp"
#include "reshard/json_io.hpp"

// Plan
#include "reshard/box.hpp"
#include "reshard/schedule.hpp"
#include "reshard/plan.hpp"
#include "reshard/plan_summary.hpp"
#include "reshard/topology.hpp"
#include "reshard/hierarchical.hpp"

// Execution
#include "reshard/transport.hpp"
#include "reshard/message_rule.hpp"
#include "reshard/copy_kernels.hpp"
#include "reshard/checksum.hpp"
#include "reshard/binding.hpp"
#include "reshard/executor.hpp"
#include "reshard/staged_executor.hpp"
#include "reshard/resharder.hpp"
#include "reshard/backends/local.hpp"
