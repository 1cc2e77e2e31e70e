// What every compile-fail test of the static layout sees. No include guard on
// purpose: static_fail.controls includes each test inside a namespace of its
// own, and each needs these using-declarations there.
#include "reshard/layout/static_layout.hpp"

using namespace reshard::st;
using reshard::DType;
