#!/usr/bin/env python3
"""Calibrates the simulator's loopback topology and compares predicted with
measured UCX refits (simulate.hpp, "Calibration").

  bench/calibration/measure.sh BUILD N > runs.jsonl
  bench/calibration/compare.py BUILD runs.jsonl

Fit (from the two 2-process cases only):
  rate    = eta * raw, raw = the UCX tagged-send bandwidth reshard-refit probes
            between the busiest pair in the same run; eta = median over the
            'large' runs (one 256 MiB contiguous tensor) of refit rate / raw.
            One host: every process is its own node (all copies are network
            flows), and all flows share the host (fabric_gbps = rate).
  latency = median refit time of the 'tiny' case (one 256-byte message).
Then, for every other case and run, reshard-plan --simulate on that topology
(fitted once: raw = median of the 'large' runs' probes; and per run: raw = that
run's own probe), against the measured median refit time."""
import json, statistics, subprocess, sys, tempfile, os

build, path = sys.argv[1], sys.argv[2]
runs = [json.loads(l) for l in open(path) if l.startswith('{')]
by = {}
for r in runs:
    by.setdefault(r['case'], []).append(r['run'])

large = by['large']
eta = statistics.median((r['bytes_moved'] / r['seconds'] / 1e9) / r['raw']['tag']['gb_per_s'] for r in large)
raw_once = statistics.median(r['raw']['tag']['gb_per_s'] for r in large)
latency_us = statistics.median(r['seconds'] for r in by['tiny']) * 1e6
C = 'bench/calibration'
args = {
    'transpose': ['--src', f'{C}/transpose-src.json', '--dst', f'{C}/transpose-dst.json'],
    'gather': ['--src', f'{C}/gather-src.json', '--dst', f'{C}/gather-dst.json'],
    'scatter': ['--src', f'{C}/scatter-src.json', '--dst', f'{C}/scatter-dst.json'],
    'tiny-moe': ['--model', '../shared/models/tiny-moe.json', '--train', 'tp=2,dp=1,ep=2', '--infer', 'tp=4'],
    'large': ['--src', 'tests/mpi/layouts/large-train.json', '--dst', 'tests/mpi/layouts/large-infer.json'],
}

def predict(case, raw):
    gbps = 8 * eta * raw
    topo = {"base": "loopback", "name": "loopback-fit", "nic_gbps": gbps, "nvlink_gbps": gbps, "fabric_gbps": gbps,
            "latency_us": latency_us, "nvlink_latency_us": latency_us, "stage_latency_us": 0}
    with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False) as f:
        json.dump(topo, f)
        name = f.name
    try:
        out = subprocess.run([f'{build}/bin/reshard-plan', *args[case], '--topology', name, '--simulate', '--stats'],
                             check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(name)
    return json.loads(out)['simulation']['predicted_seconds']

print(f'fit: eta = {eta:.3f} (refit / raw on the 2-process 256 MiB case), raw = {raw_once:.3f} GB/s '
      f'-> loopback rate {eta * raw_once:.3f} GB/s; latency {latency_us:.1f} us')
print('| case | processes | measured median (ms) | predicted, fitted once (ms) | ratio | predicted, per-run probe (ms) | ratio |')
print('|---|---|---|---|---|---|---|')
for case in ['transpose', 'gather', 'scatter', 'tiny-moe']:
    if case not in by: continue
    rs = by[case]
    meas = statistics.median(r['seconds'] for r in rs)
    once = predict(case, raw_once)
    per = statistics.median(predict(case, r['raw']['tag']['gb_per_s']) for r in rs)
    np = rs[0]['src_ranks'] + rs[0]['dst_ranks']
    print(f'| {case} | {np} | {meas*1e3:.1f} | {once*1e3:.1f} | {once/meas:.2f} | {per*1e3:.1f} | {per/meas:.2f} |')
