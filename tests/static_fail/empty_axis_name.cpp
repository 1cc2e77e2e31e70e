// expect: a mesh axis needs a non-empty name
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
MeshOf<Axis<"tp", 2>> mesh;
#else
MeshOf<Axis<"", 2>> mesh;
#endif
