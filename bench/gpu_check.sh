#!/usr/bin/env bash
# The device check (issue 5), for one GPU, in about 5 minutes including the
# build: configures a fresh build of only what it needs, then runs
#   1. test_cuda_kernels  the CUDA box copy kernels against the host reference
#                         (element sizes, ranks, shapes, misalignment, casts)
#   2. gpu-bandwidth      pack/unpack bandwidth against cudaMemcpy D2D (ratio)
#   3. test_cuda_refit    full refits with device memory through the local
#                         transport (ranks as threads sharing the GPU): the
#                         stream contract, and FP8 destinations quantized by
#                         the CUDA kernels, bitwise against the reference
#   4. test_cuda_nccl     NCCL on one rank (self send, errors, deadline)
#   5. reshard-refit --transport nccl (where CLI11 and MPI are installed):
#                         one rank, colocated (every copy by the kernels on the
#                         GPU, through the NCCL transport's setup), and two ranks
#                         on one GPU, which must fail naming the one-GPU-per-rank
#                         rule instead of hanging in NCCL
#   6. compute-sanitizer memcheck and racecheck of the device refit (where
#                         compute-sanitizer is installed)
#   7. test_cuda_quantize the FP8 quantize kernels against the host kernel, bit
#                         for bit (block 128x128 and MXFP8; bf16, f16, f32)
#   8. test_cuda_delta    the delta diff / scatter kernels against the host's
#                         encode and decode (densities 0 to 100%, malformed payloads)
#  10. CUDA tensors from Python (issue 41; where the device's Python has torch,
#      nanobind and pytest): the module built with the CUDA copy engine, its
#      GPU tests (python/tests/test_cuda_tensors.py: refits of CUDA tensors
#      against the contract oracle, ordered after the caller's stream), the
#      refit against torch's D2D copy of the same bytes
#      (bench/python_cuda_refit.py, ratio >= 0.9 the goal for large pieces)
#      and racecheck of the stream-order test. NOT RUN YET.
#   9. with 2 or more GPUs only (NOT RUN YET: every device lent so far had
#      one GPU): reshard-refit --transport nccl between processes, one GPU
#      each: a colocated tp=2 -> tp=1,dp=2 refit (every rank receives the
#      other's half over NCCL), the same with MoE experts (many messages per
#      pair, so NcclOptions::max_group_ops bounds real groups), and a 4-GPU
#      disaggregated tp=2 -> tp=2 where 4 are visible; validated element by
#      element by the tool (its JSON's "validated")
# and writes everything to OUTDIR/gpu_check.txt (build log: OUTDIR/build.log).
#
#   bash bench/gpu_check.sh OUTDIR          (ARCH=90 by default; BUILD=dir to reuse a build)
#   BIN=dir bash bench/gpu_check.sh OUTDIR  runs test binaries built elsewhere
#                                           (build/bin of an sm_90 build here), so the
#                                           device's minutes go to the tests, not a build
#
# On a machine without the Debian packages (the device machines here have
# nvcc, CMake and PyTorch's pip packages, nothing else): DEPS=prefix names a
# copy of the header libraries' installs (nlohmann-json, fmt with its .so,
# doctest: include/, lib/, share/ as under /usr; bench/device_deps.sh makes
# it), and NCCL is taken from the
# nvidia-nccl pip package when none is next to the toolkit.
set -u
OUTDIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$SRC/build-gpu-check}
ARCH=${ARCH:-90}
R="$OUTDIR/gpu_check.txt"
JOBS=$(nproc 2>/dev/null || echo 4)
start=$(date +%s)

{
  echo "# reshard device check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$SRC" diff --quiet 2>/dev/null || echo ' (with local changes)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  nvcc --version 2>/dev/null | tail -1 | sed 's/^/nvcc: /'
} > "$R"

echo "## build (arch $ARCH)" >> "$R"
extra=()
if [ -n "${DEPS:-}" ]; then
  DEPS=$(cd "$DEPS" && pwd)
  extra+=("-DCMAKE_PREFIX_PATH=$DEPS")
  export LD_LIBRARY_PATH="$DEPS/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
# NCCL: next to the toolkit, NCCL_ROOT, or the pip package (whose library
# has no unversioned name: a shim folder gives it one).
cuda_root=$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")
if [ -z "${NCCL_ROOT:-}" ] && [ ! -f "$cuda_root/include/nccl.h" ]; then
  pipnccl=$(python3 -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
  if [ -n "$pipnccl" ] && [ -f "$pipnccl/include/nccl.h" ]; then
    export NCCL_ROOT="$OUTDIR/nccl-shim"
    mkdir -p "$NCCL_ROOT/lib"
    ln -sfn "$pipnccl/include" "$NCCL_ROOT/include"
    ln -sf "$(ls "$pipnccl"/lib/libnccl.so* | head -1)" "$NCCL_ROOT/lib/libnccl.so"
    export LD_LIBRARY_PATH="$pipnccl/lib:${LD_LIBRARY_PATH:-}"
  fi
fi
echo "nccl: ${NCCL_ROOT:-next to the toolkit ($cuda_root)}" >> "$R"
# The tools need CLI11 (and reshard-refit-nccl MPI): built where present,
# unless TOOLS=OFF is given (a shorter check).
if [ -z "${TOOLS:-}" ]; then
  TOOLS=OFF
  [ -f /usr/include/CLI/CLI.hpp ] && command -v mpirun > /dev/null && TOOLS=ON
fi
if [ -n "${BIN:-}" ]; then
  BIN=$(cd "$BIN" && pwd)
  TOOLS=OFF
  # The pip NCCL's library (libnccl.so.2) for binaries linked elsewhere.
  [ -n "${pipnccl:-}" ] && export LD_LIBRARY_PATH="$pipnccl/lib:${LD_LIBRARY_PATH:-}"
  # Libraries copied beside them (libfmt, libcudart) where the machine lacks them.
  export LD_LIBRARY_PATH="$BIN/lib:${LD_LIBRARY_PATH:-}"
  echo "prebuilt binaries: $BIN (no build)" >> "$R"
else
if ! cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DRESHARD_BUILD_TOOLS=$TOOLS \
      "${extra[@]}" > "$OUTDIR/build.log" 2>&1; then
  echo "CONFIGURE FAILED" >> "$R"; tail -40 "$OUTDIR/build.log" >> "$R"; exit 1
fi
grep -E "reshard: (CUDA|NCCL|nvcc)" "$OUTDIR/build.log" >> "$R"
targets="test_cuda_kernels gpu-bandwidth test_cuda_refit test_cuda_nccl test_cuda_quantize test_cuda_delta"
[ $TOOLS = ON ] && targets="$targets reshard-refit reshard-refit-nccl"
if ! cmake --build "$BUILD" -j"$JOBS" --target $targets >> "$OUTDIR/build.log" 2>&1; then
  echo "BUILD FAILED" >> "$R"; grep -E "error" -A3 "$OUTDIR/build.log" | head -60 >> "$R"; exit 1
fi
echo "built in $(( $(date +%s) - start )) s" >> "$R"
  BIN="$BUILD/bin"
fi

status=0
summary=""
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "## $name" >> "$R"
  local t0=$(date +%s)
  timeout "$limit" "$@" >> "$R" 2>&1
  local rc=$?
  echo "-> $name: rc=$rc in $(( $(date +%s) - t0 )) s" >> "$R"
  if [ $rc -eq 0 ]; then summary+="$name: PASS"$'\n'; else summary+="$name: FAIL (rc $rc)"$'\n'; status=1; fi
}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# `--gpu` runs each program's "gpu" cases (tests/cuda_test_main.cpp); without
# a GPU they exit 77 (skipped), which fails this check like any non-zero exit.
if ! nvidia-smi -L >> "$R" 2>&1; then
  echo "NO GPU VISIBLE: the tests below exit 77 (skipped); this check FAILS" >> "$R"
  summary+="gpu: NONE VISIBLE"$'\n'
  status=1
fi
run kernels 90 "$BIN/test_cuda_kernels" --gpu
run bandwidth 90 "$BIN/gpu-bandwidth" --reps 10 --gib 1
run device-refit 90 "$BIN/test_cuda_refit" --gpu
run nccl-self 90 "$BIN/test_cuda_nccl" --gpu
run nccl-cpu 60 "$BIN/test_cuda_nccl"
# The FP8 quantize and delta kernels (issues 20, 21) against their host kernels;
# compiled and skipped on the development host, which has no GPU.
run quantize-kernels 90 "$BIN/test_cuda_quantize" --gpu
run delta-kernels 90 "$BIN/test_cuda_delta" --gpu
if [ $TOOLS = ON ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 NCCL_SOCKET_IFNAME=lo
  model="$SRC/examples/models/tiny-llama.json"
  run nccl-refit-1rank 120 mpirun -np 1 "$BIN/reshard-refit" --transport nccl --model "$model" --train tp=1 --infer tp=1 --colocate \
      --iterations 3 --json
  # Two ranks on one GPU (the device machine has one): every rank must name
  # the rule, and the job fail, instead of NCCL hanging.
  # (The output goes to the report by echo: a `tee /dev/stderr` here would
  # reopen the report and truncate it.)
  run nccl-refit-2ranks-1gpu 120 bash -c "out=\$(mpirun -np 2 '$BIN/reshard-refit' --transport nccl --model '$model' --train tp=1 \
      --infer tp=1 --no-baseline --json 2>&1); echo \"\$out\"; grep -q 'needs one GPU per rank' <<< \"\$out\""
  # Several GPUs, one per process (the tool sets each rank's GPU to its
  # node-local rank): NCCL between processes. Nothing here has run yet.
  # Each passes when the tool's JSON says the refit validated.
  validated() {  # ranks, reshard-refit arguments...
    local n=$1; shift
    echo "out=\$(mpirun -np $n '$BIN/reshard-refit' --transport nccl $* --iterations 3 --json 2>&1); echo \"\$out\"; \
grep -q '\"validated\":true' <<< \"\$out\""
  }
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "$gpus" -ge 2 ]; then
    run nccl-refit-2gpus 180 bash -c "$(validated 2 --model "$model" --train tp=2 --infer tp=1,dp=2 --colocate)"
    run nccl-refit-2gpus-moe 180 bash -c "$(validated 2 --model "$SRC/examples/models/tiny-moe.json" --train tp=1,dp=2,ep=2 \
        --infer tp=2 --colocate)"
  else
    echo "## NCCL between processes on several GPUs: SKIPPED ($gpus GPU visible; needs 2)" >> "$R"
  fi
  if [ "$gpus" -ge 4 ]; then
    run nccl-refit-4gpus 180 bash -c "$(validated 4 --model "$model" --train tp=2 --infer tp=2)"
  fi
else
  echo "## reshard-refit --transport nccl: SKIPPED (CLI11 or mpirun not installed on this machine)" >> "$R"
fi
if command -v compute-sanitizer > /dev/null; then
  run memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 "$BIN/test_cuda_refit" --gpu
  run racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 1 "$BIN/test_cuda_refit" --gpu
  # One case (every kernel, every chunk mode but dense, small sizes): the
  # sanitizers slow the kernels down many times.
  run delta-memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 "$BIN/test_cuda_delta" --gpu --test-case="*clustered*"
  run delta-racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 1 "$BIN/test_cuda_delta" --gpu --test-case="*clustered*"
  run quantize-memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 "$BIN/test_cuda_quantize" --gpu --test-case="*one dim*"
else
  echo "## compute-sanitizer: SKIPPED (not installed)" >> "$R"
fi

# 10. CUDA tensors from Python: the module needs nanobind in the Python that
# builds it (the device machines have no network: PYTHON= one that has it).
PY=${PYTHON:-python3}
if "$PY" -c "import torch, nanobind, pytest" > /dev/null 2>&1; then
  PYB="$BUILD-python"
  # Processes sharing the GPU (cuda_ipc) need UCX with CUDA: the libucx-cu13
  # wheel where that Python has it (the test skips, saying so, without).
  ucx=()
  if "$PY" -c "import libucx" > /dev/null 2>&1; then
    ucx=(-DRESHARD_UCX_WHEEL=ON -DPython3_EXECUTABLE="$(command -v "$PY")")
    echo "python-cuda: the module on the libucx-cu13 wheel's UCX" >> "$R"
  fi
  if cmake -S "$SRC" -B "$PYB" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DRESHARD_BUILD_PYTHON=ON \
        -DRESHARD_BUILD_TESTS=OFF -DRESHARD_BUILD_TOOLS=OFF -DPython_EXECUTABLE="$(command -v "$PY")" "${extra[@]}" "${ucx[@]}" \
        >> "$OUTDIR/build.log" 2>&1 && cmake --build "$PYB" -j"$JOBS" --target _core >> "$OUTDIR/build.log" 2>&1; then
    pkg="$OUTDIR/pypkg"
    rm -rf "$pkg" && mkdir -p "$pkg" && cp -r "$SRC/python/reshard" "$pkg/" && cp "$PYB"/python/_core*.so "$PYB"/python/_build.py "$pkg/reshard/"
    run python-cuda-tests 240 env PYTHONPATH="$pkg" "$PY" -m pytest -q -p no:cacheprovider "$SRC/python/tests/test_cuda_tensors.py"
    run python-cuda-bench 180 env PYTHONPATH="$pkg" "$PY" "$SRC/bench/python_cuda_refit.py" --mib 1024 --iterations 5
    if command -v compute-sanitizer > /dev/null; then
      run python-cuda-racecheck 240 compute-sanitizer --tool racecheck --error-exitcode 1 env PYTHONPATH="$pkg" "$PY" -m pytest -q \
          -p no:cacheprovider "$SRC/python/tests/test_cuda_tensors.py" -k "waits_for_the_callers_stream or llama-block"
    fi
  else
    echo "## python-cuda: BUILD FAILED" >> "$R"; grep -E "error" -A3 "$OUTDIR/build.log" | tail -30 >> "$R"
    summary+="python-cuda: BUILD FAILED"$'\n'; status=1
  fi
else
  echo "## python-cuda: SKIPPED ($PY lacks torch, nanobind or pytest)" >> "$R"
fi

{
  echo "## summary (total $(( $(date +%s) - start )) s)"
  printf "%s" "$summary"
} >> "$R"
cat "$R"
exit $status
