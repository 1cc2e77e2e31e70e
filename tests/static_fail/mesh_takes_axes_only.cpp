// expect: MeshOf<...> takes mesh axes only
#include "reshard/layout/static_layout.hpp"

using namespace reshard::st;
using reshard::DType;

#ifdef RESHARD_STATIC_FAIL_CONTROL
MeshOf<Axis<"tp", 2>> mesh;
#else
MeshOf<Axis<"tp", 2>, int> mesh;
#endif
