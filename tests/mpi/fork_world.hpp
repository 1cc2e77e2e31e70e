#pragma once
// A multi-process job without mpirun: the test process forks N children
// (ranks 0..N-1) and serves as their all-gather store over one socketpair per
// child. Each child gets a reshard::Bootstrap built with make_bootstrap (the
// caller-supplied all-gather path of the transports). The store notices a
// child that dies (EOF on its socket) and fails every all-gather waiting on
// it with "store: rank K died (...)", like a real store would; a child that
// hangs is killed at the time limit and reported as hung.
//
// Only the children may start UCX (never fork a process that has).
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "reshard/transport/bootstrap.hpp"

namespace fork_world {

using reshard::Blobs;
using reshard::Bootstrap;
using reshard::Clock;

struct Outcome {
  int rank = -1;
  bool exited = false;  ///< exited normally (else killed by a signal)
  int code = -1;        ///< exit code when exited
  int signal = 0;       ///< signal when killed
  bool hung = false;    ///< killed by the harness at the time limit
  std::string report;   ///< what the child reported (report() calls, joined by newlines)
  double seconds = 0;   ///< from the start of the job to the child's end
};

struct Options {
  std::chrono::milliseconds limit{60'000};
  /// Once every live child is stopped (SIGSTOP), kill them (a test of a stalled peer).
  bool kill_leftovers = false;
};

namespace detail {

inline bool write_all(int fd, const void* p, std::size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);  // a dead peer must not kill us with SIGPIPE
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}
inline bool read_all(int fd, void* p, std::size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}
inline bool send_frame(int fd, std::uint8_t type, const void* p, std::uint64_t n) {
  return write_all(fd, &type, 1) && write_all(fd, &n, 8) && write_all(fd, p, n);
}
inline bool recv_frame(int fd, std::uint8_t& type, std::vector<std::byte>& out) {
  std::uint64_t n = 0;
  if (!read_all(fd, &type, 1) || !read_all(fd, &n, 8)) return false;
  out.resize(n);
  return read_all(fd, out.data(), n);
}

/// The child's side: one all-gather through the parent.
inline Blobs child_all_gather(int fd, int rank, std::span<const std::byte> mine, reshard::Deadline deadline, const Bootstrap::Idle& idle) {
  if (!send_frame(fd, 1, mine.data(), mine.size())) throw reshard::TransportError(fmt::format("store: rank {} lost the store", rank));
  while (true) {
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, 2);
    if (r > 0) break;
    if (idle) idle();
    if (Clock::now() >= deadline) throw reshard::TransportError(fmt::format("store: rank {} timed out in an all-gather", rank));
  }
  std::uint8_t status = 0;
  std::vector<std::byte> payload;
  if (!recv_frame(fd, status, payload)) throw reshard::TransportError(fmt::format("store: rank {} lost the store", rank));
  if (status != 0) throw reshard::TransportError(std::string(reinterpret_cast<const char*>(payload.data()), payload.size()));
  Blobs out;
  std::size_t pos = 0;
  while (pos < payload.size()) {
    std::uint64_t n = 0;
    std::memcpy(&n, payload.data() + pos, 8);
    pos += 8;
    out.emplace_back(payload.begin() + static_cast<std::ptrdiff_t>(pos), payload.begin() + static_cast<std::ptrdiff_t>(pos + n));
    pos += n;
  }
  return out;
}

}  // namespace detail

/// Child body: gets its bootstrap and a report() to send text to the parent;
/// returns the child's exit code.
using Body = std::function<int(int rank, Bootstrap& boot, const std::function<void(const std::string&)>& report)>;

inline std::vector<Outcome> run(int n, const Body& body, Options opt = {}) {
  struct Child {
    pid_t pid = -1;
    int fd = -1;
    bool alive = true, waiting = false, stopped = false;
    std::vector<std::byte> blob;
    Outcome out;
  };
  std::vector<Child> kids(static_cast<std::size_t>(n));
  const auto start = Clock::now();
  std::vector<std::int64_t> ranks(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) ranks[static_cast<std::size_t>(i)] = i;
  std::fflush(stdout);
  std::fflush(stderr);
  for (int i = 0; i < n; ++i) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) throw std::runtime_error("socketpair failed");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::close(sv[0]);
      for (int k = 0; k < i; ++k) ::close(kids[static_cast<std::size_t>(k)].fd);
      const int fd = sv[1];
      int code = 1;
      try {
        Bootstrap boot = reshard::make_bootstrap(
            i, ranks, [fd, i](std::span<const std::byte> mine, reshard::Deadline d, const Bootstrap::Idle& idle) {
              return detail::child_all_gather(fd, i, mine, d, idle);
            },
            "store");
        auto report = [fd](const std::string& s) { detail::send_frame(fd, 2, s.data(), s.size()); };
        code = body(i, boot, report);
      } catch (const std::exception& e) {
        const std::string s = fmt::format("uncaught: {}", e.what());
        detail::send_frame(fd, 2, s.data(), s.size());
        code = 3;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);
    }
    ::close(sv[1]);
    kids[static_cast<std::size_t>(i)].pid = pid;
    kids[static_cast<std::size_t>(i)].fd = sv[0];
    kids[static_cast<std::size_t>(i)].out.rank = i;
  }
  std::string death;  // first death, once known: every gather fails with it
  auto drain = [&](Child& c) {  // reports still in the socket of a child that ended
    while (true) {
      pollfd p{c.fd, POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) return;
      std::uint8_t type = 0;
      std::vector<std::byte> data;
      if (!detail::recv_frame(c.fd, type, data)) return;
      if (type != 2) continue;
      if (!c.out.report.empty()) c.out.report += "\n";
      c.out.report.append(reinterpret_cast<const char*>(data.data()), data.size());
    }
  };
  auto record = [&](Child& c, int st, bool hung) {
    drain(c);
    c.alive = false;
    c.out.hung = hung;
    c.out.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (WIFEXITED(st)) {
      c.out.exited = true;
      c.out.code = WEXITSTATUS(st);
    } else if (WIFSIGNALED(st)) {
      c.out.signal = WTERMSIG(st);
    }
    ::close(c.fd);
    if (death.empty() && !hung && !(c.out.exited && c.out.code == 0))
      death = c.out.exited ? fmt::format("store: rank {} exited with code {}", c.out.rank, c.out.code)
                           : fmt::format("store: rank {} died (signal {})", c.out.rank, c.out.signal);
  };
  auto reap = [&](Child& c, bool hung) {
    int st = 0;
    ::waitpid(c.pid, &st, 0);
    record(c, st, hung);
  };
  auto reply_error = [&](Child& c, const std::string& msg) {
    detail::send_frame(c.fd, 1, msg.data(), msg.size());
    c.waiting = false;
  };
  while (true) {
    // Children that ended or stopped (SIGSTOP) without the store noticing yet.
    for (auto& c : kids) {
      if (!c.alive) continue;
      int st = 0;
      const pid_t w = ::waitpid(c.pid, &st, WNOHANG | WUNTRACED);
      if (w == c.pid && WIFSTOPPED(st)) c.stopped = true;
      else if (w == c.pid) record(c, st, false);
    }
    std::vector<pollfd> fds;
    std::vector<std::size_t> who;
    for (std::size_t i = 0; i < kids.size(); ++i)
      if (kids[i].alive) {
        fds.push_back(pollfd{kids[i].fd, POLLIN, 0});
        who.push_back(i);
      }
    if (fds.empty()) break;
    if (Clock::now() - start > opt.limit) {
      for (auto i : who) {
        ::kill(kids[i].pid, SIGKILL);
        reap(kids[i], true);
      }
      break;
    }
    if (opt.kill_leftovers) {
      bool only_stopped = true;
      for (auto i : who) only_stopped &= kids[i].stopped;
      if (only_stopped) {
        for (auto i : who) {
          ::kill(kids[i].pid, SIGKILL);
          reap(kids[i], false);
        }
        continue;
      }
    }
    const int r = ::poll(fds.data(), fds.size(), 10);
    if (r <= 0) continue;
    for (std::size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Child& c = kids[who[k]];
      std::uint8_t type = 0;
      std::vector<std::byte> data;
      if (!detail::recv_frame(c.fd, type, data)) {
        reap(c, false);
        continue;
      }
      if (type == 2) {
        if (!c.out.report.empty()) c.out.report += "\n";
        c.out.report.append(reinterpret_cast<const char*>(data.data()), data.size());
      } else {
        c.blob = std::move(data);
        c.waiting = true;
      }
    }
    if (!death.empty()) {
      for (auto& c : kids)
        if (c.alive && c.waiting) reply_error(c, death);
      continue;
    }
    bool all = true;
    for (auto& c : kids) all &= c.alive && c.waiting;
    if (all) {
      std::vector<std::byte> payload;
      for (auto& c : kids) {
        const std::uint64_t len = c.blob.size();
        const auto* lp = reinterpret_cast<const std::byte*>(&len);
        payload.insert(payload.end(), lp, lp + 8);
        payload.insert(payload.end(), c.blob.begin(), c.blob.end());
      }
      for (auto& c : kids) {
        detail::send_frame(c.fd, 0, payload.data(), payload.size());
        c.waiting = false;
      }
    }
  }
  std::vector<Outcome> out;
  for (auto& c : kids) out.push_back(c.out);
  return out;
}

inline std::string describe(const std::vector<Outcome>& os) {
  std::string s;
  for (const auto& o : os)
    s += fmt::format("rank {}: {} after {:.2f} s{}: {}\n", o.rank,
                     o.hung ? "HUNG" : o.exited ? fmt::format("exit {}", o.code) : fmt::format("signal {}", o.signal), o.seconds,
                     o.hung ? " (killed by the harness)" : "", o.report);
  return s;
}

}  // namespace fork_world
