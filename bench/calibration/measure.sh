#!/bin/sh
# Measures UCX refits on loopback for the simulator's calibration
# (simulate.hpp, "Calibration"). Usage: bench/calibration/measure.sh BUILD_DIR REPEATS
# Prints one JSON line per run: {"case", "np", ...reshard-refit --json fields}.
B=${1:-build}; N=${2:-3}
run() {
  name=$1; np=$2; shift 2
  i=0
  while [ $i -lt $N ]; do
    out=$(UCX_NET_DEVICES=lo mpirun --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl self,vader,tcp \
      --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo -x UCX_NET_DEVICES -np $np \
      $B/bin/reshard-refit --transport ucx "$@" --no-baseline --json 2>/dev/null | tail -1)
    echo "{\"case\":\"$name\",\"np\":$np,\"run\":$out}"
    i=$((i+1))
  done
}
C=bench/calibration
run large 2 --src tests/mpi/layouts/large-train.json --dst tests/mpi/layouts/large-infer.json --iterations 5
run tiny 2 --src $C/tiny-src.json --dst $C/tiny-dst.json --iterations 21
run many 2 --src $C/many-src.json --dst $C/many-dst.json --iterations 21
run msgs 2 --src $C/msgs-src.json --dst $C/msgs-dst.json --iterations 21
# 64 MiB packed one way (4096 contiguous 16 KiB tensors, below zero_copy_min:
# copied into staging and out again): with 'many', the staging copy cost.
run packed2 2 --src $C/packed2-src.json --dst $C/packed2-dst.json --iterations 11
# 2-process checks the fit never sees (every process has a core, as on a
# cluster): a bidirectional swap (128 MiB zero-copy each way at once) and a
# mix of packed and zero-copy pieces one way.
run swap2 2 --src $C/swap2-src.json --dst $C/swap2-dst.json --iterations 5
run pieces2 2 --src $C/pieces2-src.json --dst $C/pieces2-dst.json --iterations 11
# Two independent pairs (0 -> 2, 1 -> 3, 128 MiB contiguous each): 4
# processes on 2 cores, zero-copy only (no packing).
run pairs4 4 --src $C/pairs4-src.json --dst $C/pairs4-dst.json --iterations 5
run transpose 4 --src $C/transpose-src.json --dst $C/transpose-dst.json --iterations 5
run gather 3 --src $C/gather-src.json --dst $C/gather-dst.json --iterations 5
run scatter 4 --src $C/scatter-src.json --dst $C/scatter-dst.json --iterations 5
run tiny-moe 6 --model examples/models/tiny-moe.json --train tp=2,dp=1,ep=2 --infer tp=4 --iterations 11
# Oversubscribed checks the fit never sees: many small packed pieces and some
# 256 KiB zero-copy pieces, 6 and 8 processes on the host's cores.
run mixed6 6 --src $C/mixed6-src.json --dst $C/mixed6-dst.json --iterations 11
run mixed8 8 --src $C/mixed8-src.json --dst $C/mixed8-dst.json --iterations 11
# Diagnostics, not predicted by compare.py: the per-refit cost with 4 and 8
# processes.
run tiny4 4 --src $C/tiny4-src.json --dst $C/tiny4-dst.json --iterations 21
run tiny8 8 --src $C/tiny8-src.json --dst $C/tiny8-dst.json --iterations 21
