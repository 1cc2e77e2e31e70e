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
bash scripts/venvs.sh package
PY=$(bash scripts/venvs.sh --python package)
B=build-ucx-wheel
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$B" -DRESHARD_UCX_WHEEL=ON -DPython3_EXECUTABLE="$PY" "${launcher[@]}"
targets=(test_ucx_conformance test_ucx_faults test_ucx_fork ucx-mpi-refit reshard-refit)
probe=0
if cmake --build "$B" --target help | grep "test_cuda_ucx_memory" > /dev/null; then  # (not -q: pipefail and SIGPIPE)
  targets+=(test_cuda_ucx_memory)
  probe=1
fi
bash scripts/build_group.sh "$B" 2 "${targets[@]}"
ctest --test-dir "$B" -L ucx --output-on-failure --no-tests=error
if [ $probe = 1 ]; then
  ctest --test-dir "$B" -R '^test_cuda_ucx_memory$' --output-on-failure --no-tests=error
fi
# The Python module against the same wheel (-DRESHARD_UCX_WHEEL=ON: its
# reshard/_build.py says so, and `import reshard` loads the wheel's UCX
# first), installed beside the venv's own package (pip --target), so the
# venv keeps the default build: the UCX version loaded, then refits across
# processes through it from Python (and, with a GPU and a driver, CUDA
# tensors between processes sharing it: test_cuda_tensors.py).
PKG="$PWD/$B/python-pkg"
rm -rf "$PKG"
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps --target "$PKG" \
  -C cmake.define.RESHARD_UCX_WHEEL=ON -C "build-dir=build-python/ucx-wheel-{wheel_tag}" .
cd python/tests
PYTHONPATH="$PKG" "$PY" -c '
import importlib.metadata, os, reshard
info, wheel = reshard.ucx_info(), importlib.metadata.version("libucx-cu13")
loaded = info["version"]
assert reshard.__file__.startswith(os.environ["PYTHONPATH"]), reshard.__file__
assert loaded == wheel, f"the module runs on UCX {loaded}, not on the wheel (UCX {wheel})"
print("python module on the wheel:", info["summary"], "| has_cuda:", reshard.has_cuda)
'
PYTHONPATH="$PKG" UCX_TLS="${UCX_TLS:-tcp,self,sm}" UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" "$PY" -m pytest -q \
  -p no:cacheprovider test_cuda_tensors.py test_multiprocess.py -k "cuda or two_refits or colocated or bad_buffer or strided"
