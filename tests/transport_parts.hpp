#pragma once
// What the tests' own transports (queue_transport.hpp, mpi/mpi_transport.hpp)
// share: the contract's names, an op in words for their messages, and a
// wait() that is wait_any() of one request (neither has a cheaper single wait).
#include <string>

#include <fmt/format.h>

#include "reshard/transport/transport.hpp"

namespace transport_parts {

using reshard::Clock;
using reshard::Deadline;
using reshard::OpKind;
using reshard::RegionHandle;
using reshard::TransferOp;
using reshard::TransportError;

inline std::string describe(const TransferOp& op) {
  return op.kind == OpKind::send ? fmt::format("send of {} bytes to rank {} (tag {:#x})", op.bytes, op.peer, op.tag)
                                 : fmt::format("receive of {} bytes from rank {} (tag {:#x})", op.bytes, op.peer, op.tag);
}

/// Base of a transport `Self` whose wait is its wait_any over one request.
template <class Self>
struct WaitIsWaitAny {
  template <class Request>
  void wait(Request& r, Deadline deadline) {
    Request* one[1] = {&r};
    static_cast<Self&>(*this).wait_any(one, deadline);
  }
};

}  // namespace transport_parts
