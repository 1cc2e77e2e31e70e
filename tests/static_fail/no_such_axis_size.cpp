// expect: the mesh has no axis of this name
// context: axis = reshard::st::axis_name{"ep"}
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
std::int64_t f(const MeshOf<Axis<"dp">, Axis<"tp", 4>>& m) { return m.size<"tp">(); }
#else
std::int64_t f(const MeshOf<Axis<"dp">, Axis<"tp", 4>>& m) { return m.size<"ep">(); }
#endif
