#!/usr/bin/env python3
"""Calibrates the simulator's loopback topology and compares predicted with
measured UCX refits (sim/simulate.hpp, "Calibration").

  bench/calibration/measure.sh BUILD N > runs.jsonl
  bench/calibration/compare.py BUILD runs.jsonl [more.jsonl ...]   (runs pooled)

Fit (from the two 2-process cases only):
  rate    = eta * raw, raw = the UCX tagged-send bandwidth reshard-refit probes
            between the busiest pair in the same run; eta = median over the
            'large' runs (one 256 MiB contiguous tensor) of refit rate / raw.
            One host: every process is its own node (all copies are network
            flows), and all flows share the host (fabric_gbps = rate).
  per message and per refit: 'tiny' (one 256-byte message) takes
            fixed + message; 'msgs' (64 tensors of 64 KiB, 64 zero-copy
            messages, 4 MiB) takes fixed + 64 x message + 4 MiB / rate: the
            medians give latency_us (each message) and stage_latency_us (the
            refit's fixed cost: its barrier and agreement).
  host_cores = the cores this machine gives these processes (the model
            stretches each message by processes / cores when there are more
            processes than cores; topology.hpp, host_cores).
Then, for every other case and run, reshard-plan --simulate on that topology
(fitted once: raw = median of the 'large' runs' probes; and per run: raw = that
run's own probe), against the measured median refit time."""
import json, statistics, subprocess, sys, tempfile, os

build, paths = sys.argv[1], sys.argv[2:]
runs = [json.loads(l) for path in paths for l in open(path) if l.startswith('{')]
by = {}
for r in runs:
    by.setdefault(r['case'], []).append(dict(r['run'], np=r['np']))

large = by['large']
eta = statistics.median((r['bytes_moved'] / r['seconds'] / 1e9) / r['raw']['tag']['gb_per_s'] for r in large)
raw_once = statistics.median(r['raw']['tag']['gb_per_s'] for r in large)
tiny_s = statistics.median(r['seconds'] for r in by['tiny'])
if 'msgs' in by:
    msgs_s = statistics.median(r['seconds'] for r in by['msgs'])
    msgs_bytes = statistics.median(r['bytes_moved'] for r in by['msgs'])
    latency_us = max(0.0, (msgs_s - tiny_s - msgs_bytes / (eta * raw_once * 1e9)) / 63) * 1e6
else:  # runs from before the 'msgs' case: all of 'tiny' per message
    msgs_s = float('nan')
    latency_us = tiny_s * 1e6
fixed_us = max(0.0, tiny_s * 1e6 - latency_us)
# Staging copies (topology staging_copy_gbps, staging_run_ns): 'many' (1000
# runs of 256 bytes, 256,000 bytes) and 'packed2' (4096 runs of 16 KiB, 64
# MiB), each one packed message, pay over 'tiny' their bytes at the rate and
# their copies, each side (pack at the source, unpack at the destination):
#   extra = 2 x (bytes / copy_rate + runs x run_cost)
copy_gbps, run_ns = 0.0, 0.0
if 'packed2' in by and 'many' in by:
    def extra(case):
        rs = by[case]
        b = statistics.median(r['bytes_moved'] for r in rs)
        return statistics.median(r['seconds'] for r in rs) - tiny_s - b / (eta * raw_once * 1e9), b
    (em, bm), (ep, bp) = extra('many'), extra('packed2')
    # em / 2 = bm / rate + 1000 c;  ep / 2 = bp / rate + 4096 c
    inv_rate = (ep / 2 - 4096 / 1000 * em / 2) / (bp - 4096 / 1000 * bm)
    c = (em / 2 - bm * inv_rate) / 1000
    if inv_rate > 0:
        copy_gbps = 8 / inv_rate / 1e9
    run_ns = max(0.0, c * 1e9)
host_cores = len(os.sched_getaffinity(0))
C = 'bench/calibration'
args = {
    'swap2': ['--src', f'{C}/swap2-src.json', '--dst', f'{C}/swap2-dst.json'],
    'pieces2': ['--src', f'{C}/pieces2-src.json', '--dst', f'{C}/pieces2-dst.json'],
    'pairs4': ['--src', f'{C}/pairs4-src.json', '--dst', f'{C}/pairs4-dst.json'],
    'transpose': ['--src', f'{C}/transpose-src.json', '--dst', f'{C}/transpose-dst.json'],
    'gather': ['--src', f'{C}/gather-src.json', '--dst', f'{C}/gather-dst.json'],
    'scatter': ['--src', f'{C}/scatter-src.json', '--dst', f'{C}/scatter-dst.json'],
    'tiny-moe': ['--model', 'examples/models/tiny-moe.json', '--train', 'tp=2,dp=1,ep=2', '--infer', 'tp=4'],
    'large': ['--src', 'tests/mpi/layouts/large-train.json', '--dst', 'tests/mpi/layouts/large-infer.json'],
    'mixed6': ['--src', f'{C}/mixed6-src.json', '--dst', f'{C}/mixed6-dst.json'],
    'mixed8': ['--src', f'{C}/mixed8-src.json', '--dst', f'{C}/mixed8-dst.json'],
}

def predict(case, raw):
    gbps = 8 * eta * raw
    topo = {"base": "loopback", "name": "loopback-fit", "nic_gbps": gbps, "nvlink_gbps": gbps, "fabric_gbps": gbps,
            "latency_us": latency_us, "nvlink_latency_us": latency_us, "stage_latency_us": fixed_us, "host_cores": host_cores,
            "staging_copy_gbps": copy_gbps, "staging_run_ns": run_ns}
    with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False) as f:
        json.dump(topo, f)
        name = f.name
    try:
        out = subprocess.run([f'{build}/bin/reshard-plan', *args[case], '--topology', name, '--simulate', '--stats'],
                             check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(name)
    sim = json.loads(out)['simulation']
    return sim['predicted_seconds'], sim['messages']

print(f'fit: eta = {eta:.3f} (refit / raw on the 2-process 256 MiB case), raw = {raw_once:.3f} GB/s '
      f'-> loopback rate {eta * raw_once:.3f} GB/s; tiny {tiny_s*1e6:.1f} us, msgs {msgs_s*1e3:.2f} ms -> {latency_us:.1f} us per '
      f'message + {fixed_us:.1f} us per refit; {host_cores} host cores; staging copies '
      f'{copy_gbps / 8:.2f} GB/s + {run_ns:.0f} ns per run')
print('| case | processes | messages sent / predicted | measured median (ms) | measured range (ms) | predicted, fitted once (ms) '
      '| ratio | predicted, per-run probe (ms) | ratio |')
print('|---|---|---|---|---|---|---|---|---|')
for case in ['swap2', 'pieces2', 'pairs4', 'transpose', 'gather', 'scatter', 'tiny-moe', 'mixed6', 'mixed8']:
    if case not in by: continue
    rs = by[case]
    meas = statistics.median(r['seconds'] for r in rs)
    once, msgs = predict(case, raw_once)
    per = statistics.median(predict(case, r['raw']['tag']['gb_per_s'])[0] for r in rs)
    np = rs[0]['np']
    sent = statistics.median(r['messages'] for r in rs)
    lo, hi = min(r['seconds'] for r in rs), max(r['seconds'] for r in rs)
    print(f'| {case} | {np} | {sent:g} / {msgs} | {meas*1e3:.1f} | {lo*1e3:.1f}-{hi*1e3:.1f} | {once*1e3:.1f} | {once/meas:.2f} '
          f'| {per*1e3:.1f} | {per/meas:.2f} |')
