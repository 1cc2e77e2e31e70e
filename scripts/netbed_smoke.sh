#!/usr/bin/env bash
# The netbed smoke run (part of the README's test command): bench/netbed's
# teardown tests (interrupts at several points, nothing left behind) and the
# refits on a small netbed (4-6 hosts, one rank each, 1 Gbit/s links, tiny
# models): dense, delta, FP8, the staged plan against the direct one on nodes
# of 2, and the gloo broadcast peer when the package venv exists
# (scripts/python_tests.sh), each validated and printed beside the
# simulator's prediction. About 20-40 s. Needs root (network namespaces);
# BUILD names the build folder (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "netbed smoke: skipped: network namespaces need root"
  exit 0
fi
bash scripts/setup.sh >/dev/null
bash bench/netbed/test_netbed.sh --quick
python3 bench/netbed/refits.py --smoke --build "${BUILD:-build}"
