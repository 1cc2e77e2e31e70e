// expect: MeshOf<...> takes mesh axes only
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
MeshOf<Axis<"tp", 2>> mesh;
#else
MeshOf<Axis<"tp", 2>, int> mesh;
#endif
