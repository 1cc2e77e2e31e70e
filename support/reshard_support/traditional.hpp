#pragma once
// The traditional refit (veRL, OpenRLHF, NeMo-RL's legacy path), expressed as
// layouts so it runs on the same planner, executor and transport as reshard
// and a comparison measures only the method:
//
//   1. gather:    src -> gathered   every tensor whole on one source rank (the
//                                   first rank of its stage holding part of it)
//   2. broadcast: gathered -> full  every destination rank of the tensor's
//                                   stage receives the whole tensor
//   3. slice:     full -> dst       each destination rank copies its shard out
//
// The logical payload is about (1 + destination ranks per stage) x the model,
// against reshard's one shard per destination rank.
#include <cstdint>
#include <vector>

#include "reshard/layout/layout.hpp"

namespace reshard {

/// Step 1's target: on src's mesh, each tensor unsplit and held only by its
/// root (a stage on every mesh axis pins it to one position).
inline Layout gather_layout(const Layout& src) {
  if (!src.validated()) fail("gather_layout: the layout is empty");
  LayoutSpec g;
  g.mesh = src.mesh;
  g.origin = src.origin + " (gathered)";
  for (std::size_t t = 0; t < src.tensors.size(); ++t) {
    const auto& ts = src.tensors[t];
    std::int64_t root = -1;
    for (std::int64_t p = 0; p < src.mesh.size() && root < 0; ++p)
      if (src.holds(p, static_cast<int>(t))) root = p;
    if (root < 0) fail("gather_layout: no rank of {} holds tensor '{}'", src.origin, ts.name);
    TensorSpec out;
    out.name = ts.name;
    out.shape = ts.shape;
    out.dtype = ts.dtype;
    for (int a = 0; a < static_cast<int>(src.mesh.axes.size()); ++a) out.stage.push_back(StageCoord{a, src.mesh.coord(root, a)});
    g.tensors.push_back(std::move(out));
  }
  return Layout(std::move(g));
}

/// Step 2's target: on dst's mesh, each tensor unsplit on every rank of its
/// stage (what a broadcast leaves behind).
inline Layout broadcast_layout(const Layout& dst) {
  if (!dst.validated()) fail("broadcast_layout: the layout is empty");
  LayoutSpec b;
  b.mesh = dst.mesh;
  b.origin = dst.origin + " (broadcast)";
  for (const auto& ts : dst.tensors) {
    TensorSpec out;
    out.name = ts.name;
    out.shape = ts.shape;
    out.dtype = ts.dtype;
    out.stage = ts.stage;
    b.tensors.push_back(std::move(out));
  }
  return Layout(std::move(b));
}

}  // namespace reshard
