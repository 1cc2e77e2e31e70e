// expect: a mesh axis has size >= 1, or reshard::st::dynamic when its size is given at runtime
// context: axis = reshard::st::axis_name{"tp"}; long int size = 0
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
MeshOf<Axis<"dp">, Axis<"tp", 1>> mesh(2);
#else
MeshOf<Axis<"dp">, Axis<"tp", 0>> mesh(2);
#endif
