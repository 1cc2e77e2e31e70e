// expect: the mesh has no axis of this name
// context: axis = reshard::st::axis_name{"ep"}
#include "reshard/layout/static_layout.hpp"

using namespace reshard::st;
using reshard::DType;

#ifdef RESHARD_STATIC_FAIL_CONTROL
std::int64_t f(const MeshOf<Axis<"dp">, Axis<"tp", 4>>& m) { return m.size<"tp">(); }
#else
std::int64_t f(const MeshOf<Axis<"dp">, Axis<"tp", 4>>& m) { return m.size<"ep">(); }
#endif
