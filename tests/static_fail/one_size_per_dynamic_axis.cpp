// expect: give the mesh one runtime size per dynamic axis, in mesh order
// context: int dynamic_axes = 2; int sizes_given = 1
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
MeshOf<Axis<"dp">, Axis<"tp">> mesh(4, 2);
#else
MeshOf<Axis<"dp">, Axis<"tp">> mesh(4);
#endif
