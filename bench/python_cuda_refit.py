#!/usr/bin/env python3
"""Refits of CUDA tensors from Python (reshard.refit_local: ranks as threads sharing one GPU) against
torch's own device-to-device copy of the same bytes (cudaMemcpy D2D underneath), on one GPU.

One bf16 weight [rows, cols] of --mib MiB, trained at tp=2 on ranks 0-1 and served whole by rank 2
(as a tp=2 trainer into a tp=1 engine):
  rows   the trainer splits rows: each rank's half is one contiguous piece (the large-piece case)
  cols   the trainer splits columns: each half is strided (packed and unpacked by reshard's kernels)
The peer does what a hand-written refit would for the same pieces: `dst[piece].copy_(src)` per rank,
timed with CUDA events. Every refit's destination is checked against torch.cat of the sources.

    python3 bench/python_cuda_refit.py [--mib 1024] [--iterations 5] [--json]
Prints one JSON line per case: seconds (median), peer_seconds, ratio (peer / reshard: >= 0.9 is the goal
for the rows case), gbps.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import reshard


def layouts(rows: int, cols: int, split_dim: int):
    dims = ["tp", None] if split_dim == 0 else [None, "tp"]
    src = {"mesh": {"axes": [["tp", 2]], "first_rank": 0},
           "tensors": [{"name": "w", "shape": [rows, cols], "dtype": "bf16", "dims": dims}], "buffers": []}
    dst = {"mesh": {"axes": [["tp", 1]], "first_rank": 2},
           "tensors": [{"name": "w", "shape": [rows, cols], "dtype": "bf16", "dims": [None, None]}], "buffers": []}
    return reshard.layout_from_json(json.dumps(src), "trainer tp=2"), reshard.layout_from_json(json.dumps(dst), "engine tp=1")


def peer_seconds(halves, dst, split_dim: int, iterations: int) -> float:
    times = []
    for _ in range(iterations):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i, h in enumerate(halves):
            dst.narrow(split_dim, i * h.shape[split_dim], h.shape[split_dim]).copy_(h)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def case(name: str, split_dim: int, mib: int, iterations: int) -> dict:
    cols = 4096
    rows = max(2, (mib * 2**20) // (2 * cols) // 2 * 2)
    src, dst = layouts(rows, cols, split_dim)
    full = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    halves = [c.contiguous() for c in full.chunk(2, dim=split_dim)]
    out = torch.full_like(full, -7.0)
    bufs = {0: {"w": halves[0]}, 1: {"w": halves[1]}, 2: {"w": out}}
    reshard.refit_local(src, dst, bufs)  # warm-up: setup, first-touch
    torch.cuda.synchronize()
    if not torch.equal(out, full):
        raise SystemExit(f"{name}: the refit's destination differs from torch.cat of the sources")
    out.fill_(-7.0)
    rep = reshard.refit_local(src, dst, bufs, iterations=iterations)
    torch.cuda.synchronize()
    if not torch.equal(out, full):
        raise SystemExit(f"{name}: the timed refits' destination differs from torch.cat of the sources")
    peer_out = torch.empty_like(full)
    peer = peer_seconds(halves, peer_out, split_dim, iterations)
    if not torch.equal(peer_out, full):
        raise SystemExit(f"{name}: the peer's copy differs")
    nbytes = full.numel() * full.element_size()
    return {"case": name, "bytes": nbytes, "seconds": rep["seconds"], "peer_seconds": peer, "ratio": peer / rep["seconds"],
            "gbps": nbytes / rep["seconds"] / 1e9, "peer_gbps": nbytes / peer / 1e9, "validated": True,
            "device": torch.cuda.get_device_name()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="the weight's size in MiB (default 1024)")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--cases", default="rows,cols")
    a = ap.parse_args()
    if not (torch.cuda.is_available() and reshard.has_cuda):
        raise SystemExit(f"needs a CUDA device (torch sees {torch.cuda.device_count()}) and reshard built with CUDA "
                         f"(has_cuda={reshard.has_cuda})")
    for name in a.cases.split(","):
        print(json.dumps(case(name, 0 if name == "rows" else 1, a.mib, a.iterations)), flush=True)


if __name__ == "__main__":
    main()
