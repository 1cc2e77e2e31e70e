#!/usr/bin/env bash
# Tests of bench/netbed/netbed.py: commands run in their hosts, links are shaped
# as asked, and whatever happens (success, failure, a killed child, a
# timeout, SIGINT / SIGTERM to netbed during setup or the run, SIGKILL of
# netbed) no namespace, link, bridge or qdisc of the run is left behind and
# the root namespace's links and qdiscs are unchanged. Needs root, iproute2.
#   bash bench/netbed/test_netbed.sh [--quick]   (--quick: skips the intra/inter-node shaping and the mpirun
#   teardown check)
set -u
cd "$(dirname "$0")/../.."
NB="python3 bench/netbed/netbed.py"
QUICK=${1:-}
TAG=$$
fails=0
pass() { echo "ok   $*"; }
fail() { echo "FAIL $*"; fails=$((fails + 1)); }
root_state() { { ip -o link show | awk -F': ' '{print $2}'; tc qdisc show; } | sort; }
BEFORE=$(root_state)
# leftovers PREFIX: prints what of PREFIX is still there (nothing when clean)
leftovers() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep "^$1" || true
  [ "$(root_state)" = "$BEFORE" ] || echo "root namespace links/qdiscs changed"
}
# expect_clean NAME PREFIX [SECONDS]: nothing of PREFIX left (waiting up to SECONDS for a guardian)
expect_clean() {
  local t=${3:-0} l
  for _ in $(seq 0 $((t * 10))); do l=$(leftovers "$2"); [ -z "$l" ] && break; sleep 0.1; done
  if [ -z "$l" ]; then pass "$1: nothing left"; else fail "$1: left behind: $l"; fi
}
expect_rc() { if [ "$2" = "$3" ]; then pass "$1: exit $2"; else fail "$1: exit $2, expected $3"; fi; }
# wait_for FILE PATTERN: until netbed's stderr says PATTERN (10 s at most)
wait_for() { for _ in $(seq 100); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done; return 1; }
LOG=$(mktemp)
trap 'rm -f "$LOG"; $NB cleanup --prefix rsnb-t${TAG}a- >/dev/null 2>&1' EXIT

P=rsnb-t${TAG}a-
out=$($NB run --quiet --hosts 3 --rate 100mbit --prefix $P --each -- sh -c 'echo {rank}/{world} {addr} $NETBED_MASTER $(ip -o -4 addr show eth0 | awk "{print \$4}")')
rc=$?; expect_rc "success" $rc 0
want=$(printf '0/3 10.213.0.1 10.213.0.1 10.213.0.1/16\n1/3 10.213.0.2 10.213.0.1 10.213.0.2/16\n2/3 10.213.0.3 10.213.0.1 10.213.0.3/16')
[ "$(echo "$out" | sort)" = "$want" ] && pass "each host runs its command with its own address" || fail "hosts' output: $out"
expect_clean "success" $P

$NB run --quiet --hosts 2 --rate 100mbit --prefix $P --each -- sh -c 'exit {rank}3'; expect_rc "failing command" $? 3
expect_clean "failing command" $P
$NB run --quiet --hosts 2 --rate 100mbit --prefix $P --each -- sh -c 'kill -9 $$'; expect_rc "child SIGKILLed" $? 137
expect_clean "child SIGKILLed" $P
$NB run --quiet --hosts 2 --rate 100mbit --prefix $P --each -- sh -c '[ {rank} = 1 ] && kill -INT $$; sleep 1007'
rc=$?; [ $rc -ne 0 ] && pass "child SIGINTed: exit $rc, others stopped" || fail "child SIGINTed: exit 0"
expect_clean "child SIGINTed" $P

t0=$(date +%s)
$NB run --quiet --hosts 3 --rate 100mbit --prefix $P --timeout 2 --grace 1 --each -- sh -c "trap '' TERM; sleep 1007"
rc=$?; dt=$(($(date +%s) - t0)); expect_rc "timeout (children ignore SIGTERM)" $rc 124
[ $dt -le 12 ] && pass "timeout bounded: ${dt} s" || fail "timeout took ${dt} s"
expect_clean "timeout" $P

NETBED_TEST_PAUSE_AFTER_HOST=1 $NB run --hosts 3 --rate 100mbit --prefix $P --each -- sleep 1007 2>"$LOG" &
pid=$!; wait_for "$LOG" "host 1 up" || fail "setup never reached host 1"; kill -TERM $pid; wait $pid
expect_rc "SIGTERM during setup" $? 143; expect_clean "SIGTERM during setup" $P

$NB run --hosts 3 --rate 100mbit --prefix $P --each -- sleep 1007 2>"$LOG" &
pid=$!; wait_for "$LOG" "hosts up" || fail "never up"; sleep 0.3; kill -INT $pid; wait $pid
expect_rc "SIGINT during the run" $? 130; expect_clean "SIGINT during the run" $P

$NB run --hosts 3 --rate 100mbit --prefix $P -- sh -c 'for n in $NETBED_NAMESPACES; do ip netns exec $n sleep 1007 & done; wait' 2>"$LOG" &
pid=$!; wait_for "$LOG" "hosts up" || fail "never up"; sleep 0.3; kill -TERM $pid; wait $pid
expect_rc "SIGTERM during a launcher's run" $? 143; expect_clean "SIGTERM during a launcher's run" $P

$NB run --hosts 3 --rate 100mbit --prefix $P --each -- sleep 1007 2>"$LOG" &
pid=$!; wait_for "$LOG" "hosts up" || fail "never up"; sleep 0.3; kill -KILL $pid; wait $pid 2>/dev/null
expect_clean "SIGKILL of netbed (its guardian sweeps)" $P 15
pgrep -f "sleep 1007" -a | grep -q . && fail "SIGKILL of netbed: a host's process survived" || pass "SIGKILL of netbed: hosts' processes gone"

$NB run --hosts 2 --rate 100mbit --prefix $P --each -- sleep 1007 2>"$LOG" &
pid=$!; wait_for "$LOG" "hosts up" || fail "never up"
g=$(pgrep -f "_guard --prefix $P ")
kill -KILL $g $pid; wait $pid 2>/dev/null
[ -n "$(leftovers $P)" ] && pass "SIGKILL of netbed and its guardian leaves the bed" || fail "expected leftovers"
$NB cleanup --prefix $P; expect_rc "cleanup --prefix" $? 0; expect_clean "cleanup after SIGKILL of both" $P

# Bad input: a clear error, exit 2, nothing created.
for args in "--hosts 2 --rate fast" "--hosts 0 --rate 1gbit" "--hosts 3 --rate 1gbit --ranks-per-node 2 --intra-rate 10gbit" \
            "--hosts 4 --rate 1gbit --ranks-per-node 2" "--hosts 2 --rate 1gbit --intra-rate 10gbit"; do
  err=$($NB run $args --prefix $P --each -- true 2>&1); rc=$?
  [ $rc = 2 ] && echo "$err" | grep -q "^netbed: " && pass "bad input ($args): $err" || fail "bad input ($args): exit $rc: $err"
done
err=$($NB run --hosts 2 --rate 1gbit --prefix other- --each -- true 2>&1); rc=$?
[ $rc = 2 ] && pass "bad prefix: $err" || fail "bad prefix accepted: $err"
err=$($NB cleanup --prefix "" 2>&1); [ $? = 2 ] && pass "cleanup refuses an empty prefix" || fail "cleanup accepted an empty prefix"
expect_clean "bad input" $P

# Shaping: one TCP stream measured against the rate asked for (within 10%).
within() { python3 -c "import json,sys; r=json.loads(sys.argv[1])['bits_per_second']; w=float(sys.argv[2]); print(f'{r/1e6:.1f} Mbit/s of {w/1e6:.0f}'); sys.exit(0 if 0.9*w <= r <= 1.02*w else 1)" "$1" "$2"; }
r=$($NB run --quiet --hosts 2 --rate 200mbit --prefix $P --each -- sh -c '[ {rank} = 0 ] && exec python3 bench/netbed/throughput.py serve 5001; python3 bench/netbed/throughput.py send {master} 5001 25000000')
m=$(within "$r" 200e6) && pass "200mbit link: $m" || fail "200mbit link: $m"
if [ "$QUICK" != --quick ]; then
  # Nodes of 2: within node 0 (host 1 -> host 0) at the intra rate, across nodes (host 3 -> host 0) at the rate.
  r1=$($NB run --quiet --hosts 4 --rate 100mbit --ranks-per-node 2 --intra-rate 1gbit --prefix $P --each -- sh -c '
    case {rank} in 0) exec python3 bench/netbed/throughput.py serve 5001;; 1) exec python3 bench/netbed/throughput.py send 10.213.0.1 5001 100000000;; *) exec true;; esac')
  m=$(within "$r1" 1e9) && pass "intra-node link (1gbit): $m" || fail "intra-node link: $m"
  r2=$($NB run --quiet --hosts 4 --rate 100mbit --ranks-per-node 2 --intra-rate 1gbit --prefix $P --each -- sh -c '
    case {rank} in 0) exec python3 bench/netbed/throughput.py serve 5001;; 3) exec python3 bench/netbed/throughput.py send 10.213.0.1 5001 12500000;; *) exec true;; esac')
  m=$(within "$r2" 100e6) && pass "inter-node link (100mbit): $m" || fail "inter-node link: $m"
  expect_clean "shaping" $P
  if command -v mpirun >/dev/null; then
    $NB run --hosts 3 --rate 100mbit --prefix $P --mpirun -- sleep 1007 2>"$LOG" &
    pid=$!; wait_for "$LOG" "hosts up" || fail "never up"; sleep 1; kill -TERM $pid; wait $pid
    expect_rc "SIGTERM during an mpirun run" $? 143; expect_clean "SIGTERM during an mpirun run" $P
    pgrep -f "sleep 1007" -a | grep -q . && fail "mpirun run: a rank survived" || pass "mpirun run: ranks gone"
  fi
fi
if command -v mpirun >/dev/null; then
  # Every rank in its own host, each with the --mpirun-arg=-x variables (mpirun gives an MPMD line's -x to one app
  # context only: netbed repeats them in each).
  out=$($NB run --quiet --hosts 3 --rate 100mbit --prefix $P --timeout 60 --mpirun --mpirun-arg=-x \
    --mpirun-arg=NB_TEST_X=x1 -- sh -c 'echo {rank} $(ip -o -4 addr show eth0 | awk "{print \$4}") ${NB_TEST_X:-unset}')
  rc=$?; want=$(printf '0 10.213.0.1/16 x1\n1 10.213.0.2/16 x1\n2 10.213.0.3/16 x1')
  [ $rc = 0 ] && [ "$(echo "$out" | sort)" = "$want" ] && pass "mpirun: rank i in host i, -x in each" || fail "mpirun: exit $rc: $out"
  expect_clean "mpirun" $P
fi
echo "netbed tests: $fails failed"
[ $fails = 0 ]
