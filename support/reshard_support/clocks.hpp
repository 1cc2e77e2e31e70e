#pragma once
// Clocks the benchmarks and tools share: wall seconds since a point, the
// process's CPU seconds (on a shared, loaded machine wall time overstates the
// work), and the process's peak resident memory.
#include <sys/resource.h>

#include <chrono>
#include <cstdint>
#include <ctime>

namespace reshard::clocks {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

/// This process's peak resident memory (getrusage; Linux reports KiB).
inline std::int64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<std::int64_t>(u.ru_maxrss) * 1024;
}

inline double peak_rss_gb() { return static_cast<double>(peak_rss_bytes()) / 1e9; }

}  // namespace reshard::clocks
