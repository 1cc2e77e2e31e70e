#!/usr/bin/env python3
"""A refit across processes that no mpirun started: each process is one rank
(as a Ray actor or a torchrun worker would be), holds its weights as torch
tensors, and meets the others through a torch.distributed.TCPStore.

Training: Megatron-Core tp=2 (ranks 0-1); inference: vLLM tp=2 (ranks 2-3),
both built from a HuggingFace config. Two refits, the weights changed in place
between them; each inference rank checks one of its tensors.

    python examples/python/multiprocess_refit.py [CONFIG.json]

(UCX on one host: the script sets UCX_TLS=tcp,self,sm and UCX_NET_DEVICES=lo
unless they are set.)
"""
import datetime
import os
import pathlib
import socket
import sys

import torch
import torch.multiprocessing as mp

import reshard

HERE = pathlib.Path(__file__).resolve().parent
CONFIG = sys.argv[1] if len(sys.argv) > 1 else str(HERE.parent.parent / "tests" / "models" / "tiny-llama.json")


def run_rank(rank: int, port: int) -> None:
    # Rank 0 hosts the store; any store with set/get works (Ray's KV, Redis ...).
    store = torch.distributed.TCPStore("127.0.0.1", port, None, rank == 0,
                                       timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    train = reshard.megatron_layout(CONFIG, "tp=2")
    infer = reshard.vllm_layout(CONFIG, "tp=2", first_rank=len(train.ranks))

    # This rank's tensors, allocated from the layout's listing (a real job
    # binds its model's own parameters: reshard.buffers_from_state_dict).
    side = train if rank in train.ranks else infer
    weights = reshard.allocate(side, rank, fill=0)
    if side is train:
        for name, t in weights.items():
            t.fill_(rank + 1)  # training rank r's shards hold r + 1

    with reshard.Resharder(train, infer, rank=rank, buffers=weights, transport="ucx", store=store) as r:
        for step in (1, 2):
            report = r.refit()
            if side is infer:
                q = weights["model.layers.0.self_attn.qkv_proj.weight"]
                print(f"rank {rank} step {step}: received {report['bytes_received']} B in {report['seconds'] * 1e3:.1f} ms; "
                      f"qkv values {sorted(set(q.float().unique().tolist()))}")
            elif step == 1:
                for t in weights.values():
                    t.mul_(10)  # an optimizer step, in place: the next refit sends the new values


def main() -> None:
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank, args=(port,), nprocs=4)


if __name__ == "__main__":
    main()
