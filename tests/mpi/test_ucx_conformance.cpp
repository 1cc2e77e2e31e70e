// The transport conformance suite (transport_conformance.hpp) on the UCX
// transport, both protocols, across real processes: fork_world.hpp forks the
// ranks and serves their all-gather (no mpirun). A rank that finds a
// violation reports it and aborts its transport, so the others fail fast.
#include <doctest/doctest.h>

#include "fork_world.hpp"
#include "reshard/transport/ucx.hpp"
#include "transport_conformance.hpp"

using namespace reshard;
using namespace std::chrono_literals;

namespace {

template <UcxProtocol P>
struct UcxHarness {
  template <class Case>
  void run(const Case& c) {
    UcxOptions uo;
    uo.protocol = P;
    uo.put_chunk = 100'000;  // the replays' larger messages go as several puts
    fork_world::Options fo;
    fo.limit = 60s;
    const auto outs = fork_world::run(
        Case::ranks,
        [&](int, Bootstrap& boot, const auto& report) {
          UcxTransport t(std::move(boot), uo);
          int code = 0;
          try {
            c(t);
          } catch (const std::exception& e) {
            report(e.what());
            t.abort(e.what());
            code = 1;
          }
          try {
            t.all_gather({}, Clock::now() + 10s);  // nobody tears down while a peer still talks to it
          } catch (const TransportError&) {
            // an aborted transport (the abort case, or a violation) fails this at once
          }
          return code;
        },
        fo);
    for (const auto& o : outs)
      if (!o.exited || o.code != 0) throw std::runtime_error(fork_world::describe(outs));
  }
};
using UcxTag = UcxHarness<UcxProtocol::tag>;
using UcxPut = UcxHarness<UcxProtocol::put>;

}  // namespace

TYPE_TO_STRING(UcxTag);
TYPE_TO_STRING(UcxPut);

RESHARD_TRANSPORT_CONFORMANCE(UcxTag, UcxPut);
