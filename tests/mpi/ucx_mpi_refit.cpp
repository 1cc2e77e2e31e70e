// Under mpirun (8 ranks): layout pairs refitted over the UCX transport with
// both protocols, checked element by element with the plan oracle's slots
// (tests/oracle.hpp via refit_util.hpp), each pair twice with new source
// values, once with a tiny staging budget (many waves, staging reused across
// waves: the one-sided protocol must wait for each receive to be re-posted).
// Every rank checks its own memory; rank 0 prints one line per case and the
// job fails (exit 1 on every rank) if any element anywhere is wrong.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "random_layouts.hpp"
#include "refit_util.hpp"
#include "reshard/json_io.hpp"
#include "reshard/presets/presets.hpp"
#include "reshard/transport/mpi_bootstrap.hpp"
#include "reshard/transport/ucx.hpp"
#include "reshard_support/ucx_refit.hpp"

using namespace reshard;

namespace {

struct Case {
  std::string name;
  Layout src, dst;
  ExecutorOptions exec;
};

std::int64_t max_rank(const Layout& a, const Layout& b) {
  std::int64_t m = 0;
  for (auto r : a.mesh.global_ranks()) m = std::max(m, r);
  for (auto r : b.mesh.global_ranks()) m = std::max(m, r);
  return m;
}

std::vector<Case> cases(int world) {
  std::vector<Case> out;
  const std::string root = RESHARD_SOURCE_DIR;
  for (const char* ex : {"colocated", "flat-bucket", "permuted-ranks"}) {
    Case c;
    c.name = fmt::format("examples/{}", ex);
    c.src = read_layout_file(root + "/examples/" + ex + "/train.json");
    c.dst = read_layout_file(root + "/examples/" + ex + "/infer.json");
    out.push_back(c);
  }
  {
    auto m = presets::model_layouts(root + "/examples/models/tiny-moe.json", "tp=2,dp=1,ep=2,etp=1", "tp=4", false);
    out.push_back(Case{"tiny-moe tp=2,dp=1,ep=2,etp=1 -> tp=4", m.train, m.infer, {}});
    auto c = presets::model_layouts(root + "/examples/models/tiny-qwen3-moe.json", "tp=2,dp=2,ep=4,etp=1", "tp=2", true);
    out.push_back(Case{"tiny-qwen3-moe tp=2,dp=2,ep=4,etp=1 -> tp=2 colocated", c.train, c.infer, {}});
  }
  // Random valid pairs (uneven, padded, cyclic, fused, flat, staged) that fit the job.
  testgen::RandomOptions ro;
  ro.max_world = 4;
  int taken = 0;
  for (std::uint64_t seed = 1; taken < 6 && seed < 400; ++seed) {
    auto p = testgen::random_layout_pair(seed, ro);
    if (max_rank(p.src, p.dst) >= world) continue;
    out.push_back(Case{fmt::format("random seed {} ({})", seed, p.ranks), p.src, p.dst, {}});
    ++taken;
  }
  // Tiny staging: many waves, staging slots reused.
  for (std::size_t i : {0u, 2u}) {
    Case c = out[i];
    c.name += " (staging 4 KiB, no zero-copy)";
    c.exec.staging_budget = 4096;
    c.exec.zero_copy_min = INT64_MAX;
    out.push_back(c);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  MpiSession mpi(argc, argv);
  const int me = mpi.rank();
  int failures = 0;
  try {
    const auto all = cases(mpi.size());
    for (auto proto : {UcxProtocol::tag, UcxProtocol::put}) {
      UcxOptions uo;
      uo.protocol = proto;
      uo.stall_timeout = std::chrono::seconds(60);
      uo.put_chunk = 1 << 16;
      UcxTransport t(mpi_bootstrap(), uo);
      for (const auto& c : all) {
        const auto t0 = Clock::now();
        auto sm = refit_test::make_side(c.src, me, true, 0);
        auto dm = refit_test::make_side(c.dst, me, false, 0);
        LocalBuffers bufs;
        bufs.src = refit_test::views(c.src, sm);
        bufs.dst = refit_test::views(c.dst, dm);
        ResharderOptions ro;
        ro.executor = c.exec;
        ro.executor.timeout = std::chrono::seconds(120);
        Resharder<Layout, UcxTransport> rs(c.src, c.dst, bufs, t, ro);
        std::int64_t wrong = 0, moved = 0;
        std::string first;
        for (std::uint64_t k = 0; k < 2; ++k) {
          if (k > 0) {
            refit_test::write_side(c.src, sm, true, k);
            refit_test::write_side(c.dst, dm, false, k);
          }
          t.all_gather({}, Clock::now() + std::chrono::seconds(60));
          const RefitReport rep = rs.refit();
          moved += rep.bytes_received;
          std::string f;
          const auto w = refit_test::count_wrong(c.dst, dm, me, k, &f);
          if (w && first.empty()) first = f;
          wrong += w;
          if (rep.bytes_received != rep.plan_bytes_received || rep.bytes_sent != rep.plan_bytes_sent) {
            ++wrong;
            if (first.empty())
              first = fmt::format("rank {} moved {}/{} bytes, planned {}/{}", me, rep.bytes_sent, rep.bytes_received, rep.plan_bytes_sent,
                                  rep.plan_bytes_received);
          }
        }
        // Gather the verdict.
        BlobWriter w;
        w.put(wrong);
        w.put(moved);
        w.put_string(first);
        const auto blobs = t.all_gather(w.buf, Clock::now() + std::chrono::seconds(60));
        std::int64_t total_wrong = 0, total_moved = 0;
        std::string any;
        for (std::size_t r = 0; r < blobs.size(); ++r) {
          BlobReader rd(blobs[r], static_cast<std::int64_t>(r), "verdict");
          total_wrong += rd.get<std::int64_t>();
          total_moved += rd.get<std::int64_t>();
          auto s = rd.get_string();
          if (any.empty()) any = s;
        }
        if (total_wrong) ++failures;
        if (me == 0)
          std::printf("%s %-55s %s (%lld bytes over UCX, %.2f s)%s%s\n", total_wrong ? "FAIL" : "ok  ", c.name.c_str(), std::string(to_string(proto)).c_str(),
                      static_cast<long long>(total_moved), std::chrono::duration<double>(Clock::now() - t0).count(), total_wrong ? ": " : "",
                      any.c_str());
        std::fflush(stdout);
      }
      t.all_gather({}, Clock::now() + std::chrono::seconds(60));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", me, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);  // the others may wait for this rank: end the job
  }
  if (me == 0) std::printf("%s\n", failures ? "FAILED" : "all cases validated");
  return failures ? 1 : 0;
}
