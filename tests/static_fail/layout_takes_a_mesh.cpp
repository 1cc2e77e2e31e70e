// expect: LayoutOf<Mesh> takes a MeshOf<Axis<...>...> type
#include "reshard/layout/static_layout.hpp"

using namespace reshard::st;
using reshard::DType;

#ifdef RESHARD_STATIC_FAIL_CONTROL
using L = LayoutOf<MeshOf<Axis<"tp", 2>>>;
static_assert(L::valid);
#else
using L = LayoutOf<Axis<"tp", 2>>;
static_assert(L::valid || true);
#endif
