// expect: a mesh needs at least one axis
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
MeshOf<Axis<"tp", 2>> mesh;
#else
MeshOf<> mesh;
#endif
