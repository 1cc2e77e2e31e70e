#pragma once
// Clocks the benchmarks share: wall seconds since a point, the process's CPU
// seconds (on a shared, loaded machine wall time overstates the work), and
// the process's peak resident memory.
#include <sys/resource.h>

#include <chrono>
#include <ctime>

namespace bench {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

inline double peak_rss_gb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1e6;  // KiB -> GB (approximately)
}

}  // namespace bench
