// expect: a flat buffer's length differs between ranks: pad it with Padded<P>, not RoundUp<M> or RoundUpPerPart<M>
#include "prelude.hpp"

using M = MeshOf<Axis<"dp", 2>, Axis<"tp", 2>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { auto a = L.add(Tensor<ColumnParallel<"tp">>("a", {8, 8}, DType::f32)); L.flat<Dim<Shard<"dp">, Padded<40>>>("bucket", a); }
#else
void f(LayoutOf<M>& L) { auto a = L.add(Tensor<ColumnParallel<"tp">>("a", {8, 8}, DType::f32)); L.flat<Dim<Shard<"dp">, RoundUp<64>>>("bucket", a); }
#endif
