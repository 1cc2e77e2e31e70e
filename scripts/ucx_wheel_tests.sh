#!/usr/bin/env bash
# The UCX transport built against the libucx-cu13 wheel (UCX 1.22 with its
# CUDA modules: -DRESHARD_UCX_WHEEL=ON) beside the main build's Debian UCX
# 1.13: the wheel into the venv scripts/python_tests.sh uses, a build folder
# of its own (build-ucx-wheel) with only the UCX targets, then its UCX tests
# (ctest -L ucx: loopback, forked and mpirun ranks) and, where CUDA is
# found, the probe of what memory that UCX moves. Part of the README's test
# command and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RESHARD_VENV:-$HOME/.cache/reshard-venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check libucx-cu13
B=build-ucx-wheel
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$B" -DRESHARD_UCX_WHEEL=ON -DPython3_EXECUTABLE="$VENV/bin/python" "${launcher[@]}"
targets=(test_ucx_conformance test_ucx_faults test_ucx_fork ucx-mpi-refit reshard-refit)
probe=0
if cmake --build "$B" --target help | grep "test_cuda_ucx_memory" > /dev/null; then  # (not -q: pipefail and SIGPIPE)
  targets+=(test_cuda_ucx_memory)
  probe=1
fi
cmake --build "$B" -j2 --target "${targets[@]}"
ctest --test-dir "$B" -L ucx --output-on-failure --no-tests=error
if [ $probe = 1 ]; then
  ctest --test-dir "$B" -R '^test_cuda_ucx_memory$' --output-on-failure --no-tests=error
fi
