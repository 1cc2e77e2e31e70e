#!/usr/bin/env bash
# Builds targets of a configured build folder side by side:
#
#   bash scripts/build_group.sh DIR JOBS TARGET...
#
# Not `cmake --build DIR --target a b c`: the Makefile generator builds the
# targets named on one command line one after another, and each of ours is
# one source file, so that compiles one file at a time. The group target
# (RESHARD_TARGET_GROUP in CMakeLists.txt) depends on all of them, so make
# runs their files in parallel. Used by scripts/sanitize.sh and
# scripts/ucx_wheel_tests.sh; the configure output goes to DIR/configure.log.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: build_group.sh DIR JOBS TARGET..." >&2
  exit 2
fi
dir=$1 jobs=$2
shift 2
list=$(IFS=';'; echo "$*")
cmake -S "$(dirname "$0")/.." -B "$dir" -DRESHARD_TARGET_GROUP="$list" >> "$dir/configure.log"
cmake --build "$dir" -j"$jobs" --target reshard-group
