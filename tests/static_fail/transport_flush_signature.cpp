// expect: reshard: a Transport's `flush` must be `void flush(Deadline)`
#include "reshard/transport/transport.hpp"

// A transport whose batch boundary has the wrong signature: the executor
// would never call it (flush_batch looks for flush(Deadline)).
struct FlushlessTransport {
  using request = int;
  std::int64_t rank() const { return 0; }
  std::span<const std::int64_t> world_ranks() const { return {}; }
  std::string_view name() const { return "flushless"; }
  reshard::RegionHandle register_memory(void*, std::size_t, reshard::MemoryKind) { return {}; }
  void deregister_memory(reshard::RegionHandle) {}
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte>, reshard::Deadline) { return {}; }
  void prepare(std::span<const reshard::TransferOp>, reshard::Deadline) {}
  request post(std::span<const reshard::TransferOp>) { return 0; }
  bool test(request&) { return true; }
  void wait(request&, reshard::Deadline) {}
  std::size_t wait_any(std::span<request* const>, reshard::Deadline) { return 0; }
  void abort(std::string_view) noexcept {}
#ifdef RESHARD_STATIC_FAIL_CONTROL
  void flush(reshard::Deadline) {}
#else
  void flush() {}
#endif
};
static_assert(reshard::check_transport<FlushlessTransport>());
