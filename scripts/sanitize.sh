#!/usr/bin/env bash
# Sanitizer and fuzzing runs (the last step of the README's test command,
# which .ci/run runs):
#
#   bash scripts/sanitize.sh [--build-only] [asan] [tsan] [fuzz]   (no stage: all three)
#
#   --build-only  configure and build the stages' folders, run nothing
#                 (scripts/test_all.sh builds them at low priority while the
#                 other tests run; the run after it finds them built)
#
#   asan  build-asan: the test suite built with g++ -fsanitize=address,undefined
#         (UBSan does not recover: any finding fails its test) and run by ctest.
#         Not run there: static_fail.* (they check that misuse does not
#         compile; no program of ours runs, so a sanitizer has nothing to see).
#         Smaller there: the random-pair sweeps of test_plan_properties
#         (RESHARD_SEEDS, see below) and the refit bench is not built.
#         Not run there either: refit.default (the 707 MB model, 5
#         iterations and the traditional baseline: about 54 s under ASan);
#         the refit.example.* and refit.usage.* runs take the same executor
#         and transport paths on smaller models.
#   tsan  build-tsan: the threaded and multi-process transport tests with
#         -fsanitize=thread: test_executor, test_resharder, test_batch_cap and
#         test_nccl_fake (bounded NCCL groups, the fake NCCL's ranks), the reshard-refit
#         checks on the in-process transport (refit.example.*
#         and refit.usage.*; refit.default is too slow under TSan), the schedule replay
#         inputs (fuzz.inputs.schedule_replay) and test_ucx_fork (UCX's fork-based
#         test). Not under TSan: the mpirun tests (ucx.mpi.*, mpi.*): Open MPI's and
#         UCX's own threads are not instrumented and TSan reports races inside
#         them that are not ours.
#   fuzz  build-fuzz: the libFuzzer targets of fuzz/ with clang and
#         address,undefined; each replays fuzz/corpus/<target> and
#         fuzz/regressions/<target>, then the three fuzz side by side for
#         RESHARD_FUZZ_SECONDS (on 2 cores each gets about 2/3 of one).
#         A crash fails the step and leaves the input in
#         build-fuzz/artifacts/<target>/; add it to fuzz/regressions/<target>/.
#
# Environment:
#   RESHARD_FUZZ_SECONDS     fuzzing time of the three, side by side (default 60)
#   RESHARD_FUZZ_RUNS        instead: fuzz each target for this many executions
#   RESHARD_FUZZ_SANITIZE    the fuzzers' sanitizers (default address,undefined;
#                            `undefined` alone runs the schedule replay about
#                            2x faster) and RESHARD_FUZZ_OPT their optimization
#                            (default -Og); a non-default pair builds in
#                            build-fuzz-<sanitizers>. The long run of 10^6
#                            executions per target (fuzz/README.md):
#                            RESHARD_FUZZ_RUNS=1000000 RESHARD_FUZZ_SANITIZE=undefined
#                            RESHARD_FUZZ_OPT=-O2 bash scripts/sanitize.sh fuzz
#   RESHARD_SAN_SEEDS        RESHARD_SEEDS for test_plan_properties under ASan
#                            (default 1:600; each sweep runs that range)
#   RESHARD_SAN_JOBS         build and ctest parallelism (default 2)
#
# Needs g++ (its libasan/libubsan/libtsan come with it), clang and
# libclang-rt-14-dev (libFuzzer and clang's sanitizer runtimes); missing
# packages are installed with apt-get, as scripts/setup.sh does.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

build_only=0
if [ "${1:-}" = --build-only ]; then
  build_only=1
  shift
fi
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(asan tsan fuzz)
for s in "${stages[@]}"; do
  case "$s" in asan|tsan|fuzz) ;; *) echo "sanitize: unknown stage '$s' (asan, tsan, fuzz)" >&2; exit 2 ;; esac
done
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

jobs=${RESHARD_SAN_JOBS:-2}
fuzz_seconds=${RESHARD_FUZZ_SECONDS:-60}
fuzz_runs=${RESHARD_FUZZ_RUNS:-}
t_start=$(date +%s)
stamp() { echo "sanitize: [$(( $(date +%s) - t_start ))s] $*"; }

# ---------------------------------------------------------------- packages
stamp "packages"
bash "$root/scripts/setup.sh" g++ clang libclang-rt-14-dev

# ------------------------------------------------------- runtime options
# Leaks count (LeakSanitizer is on with ASan), except inside the MPI and UCX
# libraries, which keep their allocations until exit by design. Open MPI
# loads its components (openmpi/mca_*.so) with dlopen and closes them before
# LeakSanitizer reports, leaving frames with no module name to suppress:
# keep them loaded (disable_dlclose) so the /openmpi/ rule can match.
supp_dir="$root/build-asan"
mkdir -p "$supp_dir"
cat > "$supp_dir/lsan.supp" <<'EOF'
leak:libmpi.so
leak:libopen-pal.so
leak:libopen-rte.so
leak:libucs.so
leak:libucp.so
leak:libuct.so
leak:libhwloc.so
leak:libevent
leak:/openmpi/
EOF
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
export LSAN_OPTIONS="suppressions=$supp_dir/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
# UCX's memory hooks patch malloc/mmap, which the sanitizers own: use UCX without them.
export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_EVENTS=no
export OMPI_MCA_mca_base_component_disable_dlclose=1

# Every executable target of a build folder but the benchmarks (nothing runs them there).
test_targets() {
  local dir=$1
  local benches=()
  local f
  for f in "$root"/bench/*.cpp; do
    [ -e "$f" ] || continue
    benches+=("$(basename "$f" .cpp | tr _ -)")
  done
  # `help` also lists per-file targets (tools/x.o, .i, .s): keep plain names.
  cmake --build "$dir" --target help | sed -n 's/^\.\.\. \([^ /]*\)$/\1/p; s/^\.\.\. \([^ /]*\) .*/\1/p' |
    grep -v -x -E 'all|clean|depend|edit_cache|rebuild_cache|install|install/local|install/strip|list_install_components|test|reshard_test_main|reshard-group' |
    grep -v -x -F -f <(printf '%s\n' "${benches[@]}" "__none__")
}

# Fails unless every regex selects at least one test of the build folder:
# a selection that matches nothing would pass while checking nothing
# (ctest --no-tests=error catches only a whole run that selects none).
expect_tests() {
  local dir=$1 re n
  shift
  for re in "$@"; do
    n=$(ctest --test-dir "$dir" -N -R "$re" | sed -n 's/^Total Tests: //p')
    if [ "${n:-0}" -eq 0 ]; then
      echo "sanitize: no test of $dir matches '$re'" >&2
      exit 1
    fi
  done
}

# Builds targets of a configured folder side by side, at -j$jobs.
build_group() {
  local dir=$1
  shift
  bash "$root/scripts/build_group.sh" "$dir" "$jobs" "$@"
}

# ------------------------------------------------------------------- ASan
if want asan; then
  stamp "asan: configure and build (build-asan, g++, address,undefined)"
  cmake -S . -B build-asan -DRESHARD_SANITIZE=address,undefined -DRESHARD_WITH_CUDA=OFF > build-asan/configure.log
  mapfile -t targets < <(test_targets build-asan)
  build_group build-asan "${targets[@]}"
fi
if want asan && [ "$build_only" -eq 0 ]; then
  stamp "asan: ctest"
  RESHARD_SEEDS=${RESHARD_SAN_SEEDS:-1:600} ctest --test-dir build-asan --output-on-failure --no-tests=error -j"$jobs" -E '^(static_fail|ucx\.mpi|mpi)\.|^example\.find_package$|^refit\.default$'
  # The mpirun tests' leaks come from inside Open MPI (its op and component
  # tables, kept until exit); the default fast unwinder stops at the first
  # frame in a system library, so LeakSanitizer would see no libmpi frame to
  # match the suppressions: unwind fully there (slower mallocs, 2 tests only).
  expect_tests build-asan '^ucx\.mpi\.' '^mpi\.'
  ASAN_OPTIONS="$ASAN_OPTIONS:fast_unwind_on_malloc=0" ctest --test-dir build-asan --output-on-failure --no-tests=error -j"$jobs" -R '^(ucx\.)?mpi\.'
  stamp "asan: passed"
fi

# ------------------------------------------------------------------- TSan
if want tsan; then
  stamp "tsan: configure and build (build-tsan, g++, thread)"
  mkdir -p build-tsan
  cmake -S . -B build-tsan -DRESHARD_SANITIZE=thread -DRESHARD_WITH_CUDA=OFF > build-tsan/configure.log
  targets=(test_executor test_resharder test_batch_cap test_nccl_fake reshard-refit fuzz-schedule-replay-inputs)
  # refit.default (the 707 MB model, 5 iterations and the traditional
  # baseline) takes over 4 minutes under TSan; the refit.example.* runs take
  # the same executor and transport paths on smaller models.
  tsan_parts=(test_executor test_resharder test_batch_cap test_nccl_fake 'refit\.example\..*' 'refit\.usage\..*'
              'fuzz\.inputs\.schedule_replay')
  # (help captured first: `grep -q` closing the pipe early would fail it under pipefail)
  tsan_help=$(cmake --build build-tsan --target help)
  if grep -q -x '\.\.\. test_ucx_fork' <<< "$tsan_help"; then
    targets+=(test_ucx_fork)
    tsan_parts+=(test_ucx_fork)
  fi
  tsan_tests="^($(IFS='|'; echo "${tsan_parts[*]}"))\$"
  build_group build-tsan "${targets[@]}"
fi
if want tsan && [ "$build_only" -eq 0 ]; then
  stamp "tsan: ctest"
  # TSan needs the address space layout it expects (no ASLR surprises on new kernels).
  setarch "$(uname -m)" -R true 2>/dev/null && tsan_prefix=(setarch "$(uname -m)" -R) || tsan_prefix=()
  expect_tests build-tsan "${tsan_parts[@]/#/^}"
  "${tsan_prefix[@]}" ctest --test-dir build-tsan --output-on-failure --no-tests=error -j"$jobs" -R "$tsan_tests"
  stamp "tsan: passed"
fi

# ------------------------------------------------------------------- fuzz
if want fuzz; then
  fuzz_san=${RESHARD_FUZZ_SANITIZE:-address,undefined}
  fuzz_opt=${RESHARD_FUZZ_OPT:--Og}
  fuzz_dir=build-fuzz
  [ "$fuzz_san" = address,undefined ] && [ "$fuzz_opt" = -Og ] || fuzz_dir="build-fuzz-${fuzz_san//,/-}"
  stamp "fuzz: configure and build ($fuzz_dir, clang, libFuzzer + $fuzz_san, $fuzz_opt)"
  mkdir -p "$fuzz_dir"
  cmake -S . -B "$fuzz_dir" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DRESHARD_SANITIZE="$fuzz_san" \
    -DRESHARD_SANITIZE_OPT="$fuzz_opt" -DRESHARD_WITH_CUDA=OFF \
    -DRESHARD_BUILD_FUZZERS=ON -DRESHARD_BUILD_TESTS=OFF -DRESHARD_BUILD_TOOLS=OFF > "$fuzz_dir/configure.log"
  fuzzers=(layout_json plan schedule_replay)
  fuzz_targets=()
  for t in "${fuzzers[@]}"; do fuzz_targets+=("fuzz-${t//_/-}"); done
  build_group "$fuzz_dir" "${fuzz_targets[@]}"
fi
if want fuzz && [ "$build_only" -eq 0 ]; then
  failed=0
  for t in "${fuzzers[@]}"; do
    exe="$fuzz_dir/bin/fuzz-${t//_/-}"
    art="$fuzz_dir/artifacts/$t"
    mkdir -p "$art" "$fuzz_dir/corpus/$t"
    inputs=("fuzz/corpus/$t")
    [ -d "fuzz/regressions/$t" ] && inputs+=("fuzz/regressions/$t")
    stamp "fuzz: $t: replaying ${inputs[*]}"
    # Files as arguments: each runs once, no fuzzing.
    mapfile -t files < <(find "${inputs[@]}" -type f | sort)
    if ! "$exe" -runs=1 "${files[@]}" > "$art/replay.log" 2>&1; then
      tail -40 "$art/replay.log"
      echo "sanitize: fuzz: $t: a corpus or regression input fails (log: $art/replay.log)" >&2
      failed=1
    fi
  done
  [ "$failed" -eq 0 ] || exit 1
  if [ -n "$fuzz_runs" ]; then
    limit=(-runs="$fuzz_runs")
    stamp "fuzz: fuzzing ${fuzzers[*]} side by side, $fuzz_runs executions each"
  else
    limit=(-max_total_time="$fuzz_seconds")
    stamp "fuzz: fuzzing ${fuzzers[*]} side by side, ${fuzz_seconds}s each"
  fi
  # -entropic=0: libFuzzer's entropic scheduling spends most of the time
  # updating feature frequencies on these targets (tens of thousands of
  # features per input); without it they run about 3x more inputs.
  pids=()
  for t in "${fuzzers[@]}"; do
    art="$fuzz_dir/artifacts/$t"
    "$fuzz_dir/bin/fuzz-${t//_/-}" "${limit[@]}" -entropic=0 -timeout=60 -rss_limit_mb=4096 -max_len=4096 \
      -print_final_stats=1 -artifact_prefix="$art/" "$fuzz_dir/corpus/$t" "fuzz/corpus/$t" > "$art/fuzz.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!fuzzers[@]}"; do
    t=${fuzzers[$i]}
    art="$fuzz_dir/artifacts/$t"
    if ! wait "${pids[$i]}"; then
      tail -60 "$art/fuzz.log"
      echo "sanitize: fuzz: $t: libFuzzer found a crash; the input is in $art/ (add it to fuzz/regressions/$t/)" >&2
      failed=1
      continue
    fi
    grep -E '^stat::(number_of_executed_units|peak_rss_mb)|^Done' "$art/fuzz.log" | tr '\n' ' ' | sed "s/^/sanitize: fuzz: $t: /"
    echo
  done
  [ "$failed" -eq 0 ] || exit 1
  stamp "fuzz: passed"
fi
if [ "$build_only" -eq 1 ]; then
  stamp "built (${stages[*]})"
else
  stamp "all requested stages passed (${stages[*]})"
fi
