// expect: LayoutOf<Mesh> takes a MeshOf<Axis<...>...> type
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
using L = LayoutOf<MeshOf<Axis<"tp", 2>>>;
static_assert(L::valid);
#else
using L = LayoutOf<Axis<"tp", 2>>;
static_assert(L::valid || true);
#endif
