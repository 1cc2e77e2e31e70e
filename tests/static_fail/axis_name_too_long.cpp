// expect: a mesh axis name has at most 47 characters
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
MeshOf<Axis<"an_axis_name_of_exactly_forty_seven_characters_", 2>> mesh;
#else
MeshOf<Axis<"an_axis_name_of_exactly_forty_eight_characters__", 2>> mesh;
#endif
