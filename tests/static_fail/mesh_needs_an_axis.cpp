// expect: a mesh needs at least one axis
#include "reshard/layout/static_layout.hpp"

using namespace reshard::st;
using reshard::DType;

#ifdef RESHARD_STATIC_FAIL_CONTROL
MeshOf<Axis<"tp", 2>> mesh;
#else
MeshOf<> mesh;
#endif
