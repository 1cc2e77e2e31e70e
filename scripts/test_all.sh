#!/usr/bin/env bash
# The README's test command (what .ci/run runs): everything built, every
# test run, in this order, stopping at the first failure:
#
#   packages   scripts/setup.sh (Debian's, with apt-get where missing)
#   venvs      scripts/venvs.sh in the background from the start: the two
#              Python environments (~15 GB of wheels the first time) download
#              while the C++ build uses the cores; waited for after CTest
#   build      cmake -S . -B build && cmake --build build -j2
#   ctest      the C++ suite
#   python     scripts/python_tests.sh (the package's tests)
#   netbed     scripts/netbed_smoke.sh (as root: ranks on hosts of their own)
#   engines    scripts/engine_tests.sh (live vLLM and Megatron-Core)
#   ucx-wheel  scripts/ucx_wheel_tests.sh (UCX 1.22 from the libucx-cu13 wheel)
#   sanitize   scripts/sanitize.sh (ASan + UBSan, TSan, the fuzzers), its
#              three build folders built from after the build on, in the
#              background at the lowest CPU priority (nice 19), so they take
#              the cycles the test steps leave idle (waiting on processes,
#              sockets, timeouts) and hardly any from them; run after them
#
# Each step is stamped with the seconds since the start, so a log gives the
# time of every step. The background jobs' logs: build/venvs.log and
# build/sanitize-build.log.
set -euo pipefail
cd "$(dirname "$0")/.."
t_start=$(date +%s)
stamp() { echo "test_all: [$(( $(date +%s) - t_start ))s] $*"; }

stamp "packages"
bash scripts/setup.sh
mkdir -p build
stamp "venvs: creating or updating in the background (log: build/venvs.log)"
bash scripts/venvs.sh > build/venvs.log 2>&1 &
venvs_pid=$!
# A failed step ends the script: the background jobs end with it (their
# children too: make's compilers, pip).
kill_tree() {
  local child
  for child in $(pgrep -P "$1" || true); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
trap 'kill_tree "$venvs_pid"' EXIT

stamp "build"
cmake -S . -B build
cmake --build build -j2
stamp "sanitizer builds: in the background at nice 19 (log: build/sanitize-build.log)"
nice -n 19 bash scripts/sanitize.sh --build-only > build/sanitize-build.log 2>&1 &
san_pid=$!
trap 'kill_tree "$venvs_pid"; kill_tree "$san_pid"' EXIT
stamp "ctest"
ctest --test-dir build --output-on-failure --no-tests=error -j2
# Waits for a background job; its log's tail when it failed.
join() {
  local pid=$1 log=$2 what=$3
  stamp "$what: waiting"
  if ! wait "$pid"; then
    tail -40 "$log"
    echo "test_all: $what failed ($log)" >&2
    exit 1
  fi
}
join "$venvs_pid" build/venvs.log "creating the Python environments"
trap 'kill_tree "$san_pid"' EXIT
for step in python_tests netbed_smoke engine_tests ucx_wheel_tests; do
  stamp "$step"
  bash "scripts/$step.sh"
done
join "$san_pid" build/sanitize-build.log "the sanitizer builds"
trap - EXIT
stamp "sanitize"
bash scripts/sanitize.sh
stamp "every step passed"
