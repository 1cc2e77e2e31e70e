#!/usr/bin/env bash
# Peak host memory of the default refit, measured with heaptrack:
#
#   bash bench/memory_check.sh [BUILD_DIR]        (default: build)
#
# Runs BUILD_DIR/bin/reshard-refit (the embedded model on the in-process
# transport) four ways: with and without the traditional baseline
# (--no-baseline), with the default staging budget (256 MiB per rank) and with
# --staging-budget 16777216. For each it prints the peak heap, the part of it
# that is the refit's buffers (what refit_harness allocates for the source
# and destination layouts, and the baseline's whole-tensor buffers), the
# staging the executor held at that moment, and the rest. The check: the peak
# exceeds the buffers by no more than the staging budget of every rank in the
# process plus a small fixed allowance (plans, programs, threads: 64 MiB).
# Exit status 1 when a run breaks that bound or does not validate.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
exe="$build/bin/reshard-refit"
[ -x "$exe" ] || { echo "memory_check: $exe not found; build first" >&2; exit 2; }
command -v heaptrack > /dev/null || { echo "memory_check: heaptrack not installed (apt-get install heaptrack)" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
allowance=$((64 << 20))

printf '%-44s %10s %10s %10s %10s %10s %s\n' "reshard-refit arguments" "peak heap" "buffers" "staging" "other" "bound" "ok"
run() {
  local name=$1
  shift
  heaptrack -o "$out/$name" "$exe" --json "$@" > "$out/$name.json" 2> "$out/$name.log" ||
    { echo "memory_check: $exe $* failed" >&2; cat "$out/$name.log" >&2; status=1; return; }
  local data
  data=$(ls "$out/$name".zst "$out/$name".gz 2>/dev/null | head -1)
  heaptrack_print --print-peaks 1 --print-allocators 0 --print-temporary 0 --print-leaks 0 --print-histogram 0 \
    --peak-limit 1000 "$data" > "$out/$name.report" 2>/dev/null
  python3 - "$out/$name.report" "$out/$name.json" "$allowance" "$*" <<'PY' || status=1
import json, re, sys
report_path, json_path, allowance, args = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
lines = open(report_path).read().splitlines()
units = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}  # heaptrack_print counts in powers of 1000
def size(s):
    m = re.match(r"([0-9.]+)([BKMGT]?)", s)
    return float(m.group(1)) * units[m.group(2)]
peak = next(size(l.split(": ")[1]) for l in lines if l.startswith("peak heap memory consumption:"))
# Each peak consumer: "2.13G peak memory consumed over N calls from", then the function.
by_fn = {}
for i, l in enumerate(lines[:-1]):
    m = re.match(r"(\S+) peak memory consumed over \d+ calls from", l)
    if m:
        fn = lines[i + 1].strip()
        by_fn[fn] = by_fn.get(fn, 0) + size(m.group(1))
buffers = sum(v for k, v in by_fn.items() if "Side::allocate" in k)
staging = sum(v for k, v in by_fn.items() if "Executor" in k)
# heaptrack prints its own lines on stdout too: the refit's report is the JSON line.
j = json.loads(next(l for l in open(json_path) if l.startswith("{")))
ranks = j["src_ranks"] + j["dst_ranks"]  # the default refit: disjoint sides, one thread per rank
bound = buffers + ranks * j["staging_budget_bytes"] + allowance
ok = peak <= bound and j["validated"]
mib = lambda b: f"{b / 2**20:.0f} MiB"
print(f"{args or '(none)':<44} {mib(peak):>10} {mib(buffers):>10} {mib(staging):>10} {mib(peak - buffers - staging):>10} "
      f"{mib(bound):>10} {'yes' if ok else 'NO'}")
sys.exit(0 if ok else 1)
PY
}
run default
run default-16m --staging-budget 16777216
run reshard --no-baseline
run reshard-16m --no-baseline --staging-budget 16777216
echo "peak heap: heaptrack's peak of the whole process; buffers: the peak of refit_harness::detail::Side::allocate (source and"
echo "destination buffers, and the baseline's whole tensors); staging: the peak of the executor's allocations (staging, programs);"
echo "other: the rest (plans, layouts, threads); bound: buffers + ranks x staging budget + 64 MiB. MiB = 2^20 bytes."
exit $status
