#!/bin/sh
# Compiler launcher (CMAKE_CXX_COMPILER_LAUNCHER, set by CMakeLists.txt): runs the
# compile command it is given (which may start with another launcher, ccache) and,
# while it runs, prints "still compiling SOURCE (N s)" every RESHARD_HEARTBEAT_SECONDS
# (20): one translation unit of the tools takes 1-3 minutes, and make says nothing
# meanwhile. The compile's exit status is this script's.
period=${RESHARD_HEARTBEAT_SECONDS:-20}
source=
prev=
for arg in "$@"; do
  [ "$prev" = "-c" ] && source=$arg
  prev=$arg
done
launcher=$$
(
  elapsed=0
  # sleep's own output goes nowhere, so an interrupted sleep never holds the build's output open.
  while sleep "$period" </dev/null >/dev/null 2>&1; do
    kill -0 "$launcher" 2>/dev/null || exit 0  # the launcher is gone (interrupted)
    elapsed=$((elapsed + period))
    echo "still compiling ${source##*/} (${elapsed} s)"
  done
) &
beat=$!
trap 'kill "$beat" 2>/dev/null; exit 130' INT TERM HUP
"$@"
rc=$?
kill "$beat" 2>/dev/null
exit "$rc"
