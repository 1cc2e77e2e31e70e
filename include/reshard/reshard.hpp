#pragma once
// Umbrella header: layouts -> plan -> schedule (-> execution).
#include "reshard/dtype.hpp"
#include "reshard/error.hpp"
#include "reshard/mesh.hpp"
#include "reshard/dim_spec.hpp"
#include "reshard/layout.hpp"
#include "reshard/storage.hpp"
#include "reshard/box.hpp"
#include "reshard/schedule.hpp"
#include "reshard/plan.hpp"
