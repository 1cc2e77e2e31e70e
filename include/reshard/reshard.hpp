#pragma once
// The core, in one include. Its folders are the data flow, and a header
// includes only from its own folder and those before it in this list
// (tests/check_include_layers.py checks it):
//   base/       dtypes, errors, hashing and small index utilities
//   layout/     mesh, dim specs, LayoutSpec / Layout, storage, static layouts
//   schedule/   strided boxes, copies and the schedule the planner emits
//   plan/       the planner (layouts -> schedule), topology, staged plans
//   transport/  the Transport concept, the in-process transport, UCX, NCCL
//   exec/       copy kernels, the executor that runs a schedule over a
//               transport, staged / delta / FP8 refits
//   resharder.hpp, commit.hpp, json_io.hpp   what a user calls
// Beside the core, each its own include and CMake target:
//   reshard/presets/presets.hpp   HF config -> Megatron / vLLM layouts   (reshard::presets)
//   reshard/transport/ucx.hpp     the UCX transport                       (reshard::ucx)
//   reshard/transport/nccl.hpp    the NCCL transport                      (reshard::nccl)
//   reshard/cuda/*                CUDA copy kernels and device engine     (reshard::cuda)
//   reshard/sim/simulate.hpp, stream_traffic.hpp   the refit simulator    (reshard::sim)
//   support/reshard_support/ (verify, traditional, fault_injection, ucx_refit): test and tool
//                                 support of this repository, not installed

// Layouts
#include "reshard/base/dtype.hpp"
#include "reshard/base/error.hpp"
#include "reshard/layout/mesh.hpp"
#include "reshard/layout/dim_spec.hpp"
#include "reshard/layout/layout.hpp"
#include "reshard/layout/storage.hpp"
#include "reshard/layout/rank_buffers.hpp"
#include "reshard/layout/static_layout.hpp"
#include "reshard/json_io.hpp"

// Schedule and plan
#include "reshard/schedule/schedule.hpp"
#include "reshard/plan/box.hpp"
#include "reshard/plan/plan.hpp"
#include "reshard/plan/plan_summary.hpp"
#include "reshard/plan/topology.hpp"
#include "reshard/plan/hierarchical.hpp"

// Execution
#include "reshard/schedule/message_rule.hpp"
#include "reshard/transport/transport.hpp"
#include "reshard/exec/copy_kernels.hpp"
#include "reshard/exec/checksum.hpp"
#include "reshard/exec/binding.hpp"
#include "reshard/exec/executor.hpp"
#include "reshard/exec/staged_executor.hpp"
#include "reshard/resharder.hpp"
#include "reshard/transport/local.hpp"
