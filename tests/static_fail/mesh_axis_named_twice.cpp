// expect: two axes of one mesh have the same name
// context: axis = reshard::st::axis_name{"tp"}
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
MeshOf<Axis<"tp", 2>, Axis<"dp", 4>> mesh;
#else
MeshOf<Axis<"tp", 2>, Axis<"tp", 4>> mesh;
#endif
