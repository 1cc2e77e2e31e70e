#!/usr/bin/env python3
"""reshard (UCX, one process per rank) against torch.distributed (gloo) bucketed
broadcast of full tensors, in the same processes, on the same layouts.

A Llama-like model (~1 GB of bf16 by default) goes from Megatron-Core tp=2 to
vLLM tp=4: 6 processes on loopback, started with torch.multiprocessing (no
mpirun), rendezvous through a TCPStore.

* reshard: reshard.Resharder(...).refit(): every inference rank receives
  exactly its pieces, straight from the training ranks that hold them.
* baseline, as RL frameworks refit today: training rank 1 sends its TP shards
  to training rank 0, which rebuilds each full HuggingFace tensor (Megatron's
  per-query-group [q; k; v], [gate; up]), packs them into buckets
  (--bucket-mb) and broadcasts each bucket to the 4 inference ranks (gloo),
  each of which slices out its vLLM shard ([q; k; v], [gate; up], row
  parallel, padded vocabulary) into its buffers.

Both write the same destination buffers; after the last iteration of each,
every destination element is compared between the two (and a checksum of the
source printed). Times: per iteration, first rank's start to last rank's end
(barrier before); the table shows the median.

    python bench/python_refit.py [--iterations 5] [--layers 8] [--hidden 2048] ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard


def model_config(a) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.hidden,
        "intermediate_size": a.intermediate, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads, "head_dim": a.hidden // a.heads, "vocab_size": a.vocab,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }


def hf_names(cfg):
    names = ["model.embed_tokens.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [p + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")]
    return names + ["model.norm.weight", "lm_head.weight"]


class Baseline:
    """Gather to training rank 0, bucketed gloo broadcast of full tensors, slice on each inference rank."""

    def __init__(self, cfg, rank, tp_train, tp_infer, first_infer, bufs, bucket_bytes):
        self.cfg, self.rank, self.tps, self.tpd, self.first = cfg, rank, tp_train, tp_infer, first_infer
        self.bufs, self.bucket_bytes = bufs, bucket_bytes
        self.H = cfg["hidden_size"]
        self.heads, self.ng = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = self.H // self.heads
        self.I = cfg["intermediate_size"]
        self.names = hf_names(cfg)
        self.group = dist.new_group([0] + list(range(first_infer, first_infer + tp_infer)))
        self.shapes = {}
        q, kv, H, I, V = self.heads * self.hd, self.ng * self.hd, self.H, self.I, cfg["vocab_size"]
        for n in self.names:
            if "q_proj" in n or "o_proj" in n:
                self.shapes[n] = (q, H) if "q_proj" in n else (H, q)
            elif "k_proj" in n or "v_proj" in n:
                self.shapes[n] = (kv, H)
            elif "gate_proj" in n or "up_proj" in n:
                self.shapes[n] = (I, H)
            elif "down_proj" in n:
                self.shapes[n] = (H, I)
            elif "norm" in n:
                self.shapes[n] = (H,)
            else:
                self.shapes[n] = (V, H)

    # Training side: Megatron shards -> full tensors (on rank 0).
    def full_tensors(self, shards):
        """shards: [rank 0's buffers, rank 1's buffers] -> {HF name: full tensor}."""
        H, hd, ng, tp = self.H, self.hd, self.ng, self.tps
        hpg = self.heads // ng
        out = {}
        V = self.cfg["vocab_size"]
        # Megatron-Core's GPTModel names (reshard.megatron_layout), pp=1.
        for n, m in (("model.embed_tokens.weight", "embedding.word_embeddings.weight"), ("lm_head.weight", "output_layer.weight")):
            out[n] = torch.cat([s[m] for s in shards])[:V]
        out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            qkv = torch.cat([s[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].view(-1, (hpg + 2) * hd, H) for s in shards])
            out[p + "self_attn.q_proj.weight"] = qkv[:, :hpg * hd].reshape(-1, H)
            out[p + "self_attn.k_proj.weight"] = qkv[:, hpg * hd:(hpg + 1) * hd].reshape(-1, H)
            out[p + "self_attn.v_proj.weight"] = qkv[:, (hpg + 1) * hd:].reshape(-1, H)
            fc1 = [s[f"decoder.layers.{i}.mlp.linear_fc1.weight"] for s in shards]
            out[p + "mlp.gate_proj.weight"] = torch.cat([f[:self.I // tp] for f in fc1])
            out[p + "mlp.up_proj.weight"] = torch.cat([f[self.I // tp:] for f in fc1])
            d = f"decoder.layers.{i}."
            out[p + "self_attn.o_proj.weight"] = torch.cat([s[d + "self_attention.linear_proj.weight"] for s in shards], 1)
            out[p + "mlp.down_proj.weight"] = torch.cat([s[d + "mlp.linear_fc2.weight"] for s in shards], 1)
            out[p + "input_layernorm.weight"] = shards[0][d + "input_layernorm.weight"]
            out[p + "post_attention_layernorm.weight"] = shards[0][d + "pre_mlp_layernorm.weight"]
        return out

    # Inference side: full tensor -> this rank's vLLM buffers.
    def scatter(self, name, full):
        t, tp, b = self.rank - self.first, self.tpd, self.bufs
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            layer = name.rsplit(".self_attn", 1)[0]
            q_rows = self.heads * self.hd // tp
            kv_parts = min(tp, self.ng)
            kv_rows = self.ng * self.hd // kv_parts
            kv_shard = t // (tp // self.ng) if tp > self.ng else t
            dst = b[layer + ".self_attn.qkv_proj.weight"]
            if "q_proj" in name:
                dst[:q_rows].copy_(full.chunk(tp)[t])
            else:
                off = q_rows + (0 if "k_proj" in name else kv_rows)
                dst[off:off + kv_rows].copy_(full.chunk(kv_parts)[kv_shard])
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            layer = name.rsplit(".mlp", 1)[0]
            rows = self.I // tp
            off = 0 if "gate_proj" in name else rows
            b[layer + ".mlp.gate_up_proj.weight"][off:off + rows].copy_(full.chunk(tp)[t])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            b[name].copy_(full.chunk(tp, 1)[t])
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = b[name].shape[0]
            lo = t * rows
            n = max(0, min(rows, full.shape[0] - lo))
            b[name][:n].copy_(full[lo:lo + n])
        else:
            b[name].copy_(full)

    def refit(self):
        r = self.rank
        if r == 1:  # training rank 1: its shards to rank 0
            for n in sorted(self.bufs):
                dist.send(self.bufs[n].contiguous(), 0)
            return
        full = None
        if r == 0:
            theirs = {}
            for n in sorted(self.bufs):
                theirs[n] = torch.empty_like(self.bufs[n])
                dist.recv(theirs[n], 1)
            full = self.full_tensors([self.bufs, theirs])
        # Buckets of whole tensors, in checkpoint order, each one broadcast.
        bucket, size = [], 0
        elem = 2
        buckets = []
        for n in self.names:
            nbytes = torch.Size(self.shapes[n]).numel() * elem
            if bucket and size + nbytes > self.bucket_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(n)
            size += nbytes
        buckets.append(bucket)
        for names in buckets:
            numels = [torch.Size(self.shapes[n]).numel() for n in names]
            if r == 0:
                flat = torch.cat([full[n].reshape(-1) for n in names])
            else:
                flat = torch.empty(sum(numels), dtype=torch.bfloat16)
            dist.broadcast(flat, 0, group=self.group)
            if r >= self.first:
                for n, piece in zip(names, flat.split(numels)):
                    self.scatter(n, piece.view(self.shapes[n]))


def timed(fn, iterations):
    out = []
    for _ in range(iterations):
        dist.barrier()
        t0 = time.time()
        fn()
        t1 = time.time()
        ts = torch.tensor([t0, t1], dtype=torch.float64)
        lo, hi = ts.clone(), ts.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        out.append(float(hi[1] - lo[0]))
    return out


def worker(rank, world, port, cfg_path, a, q, master="127.0.0.1"):
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore(master, port, world, rank == 0, timeout=datetime.timedelta(seconds=300))
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world)
        cfg = json.load(open(cfg_path))
        src = reshard.megatron_layout(cfg_path, f"tp={a.train_tp}")
        dst = reshard.vllm_layout(cfg_path, f"tp={a.infer_tp}", first_rank=len(src.ranks))
        g = torch.Generator().manual_seed(1000 + rank)
        bufs = {}
        if rank in src.ranks:
            for b in reshard.buffer_specs(src, rank):
                # Replicated tensors (the norms) hold the same values on every rank.
                gen = torch.Generator().manual_seed(zlib.crc32(b["name"].encode())) if len(b["shape"]) == 1 else g
                bufs[b["name"]] = torch.randn(b["shape"], generator=gen, dtype=torch.float32).to(torch.bfloat16)
        if rank in dst.ranks:
            bufs.update(reshard.allocate(dst, rank, fill=0))
        r = reshard.Resharder(src, dst, rank=rank, buffers=bufs, transport="ucx", store=store, prefix="bench",
                              fast_data_endpoint=a.fast)
        base = Baseline(cfg, rank, a.train_tp, a.infer_tp, len(src.ranks),
                        {n: t for n, t in bufs.items() if (rank in dst.ranks) == (n in {b["name"] for b in reshard.buffer_specs(dst, rank)})},
                        a.bucket_mb << 20)
        plan = reshard.plan(src, dst).stats
        r.refit()  # warm-up: endpoints, registrations
        reshard_s, base_s = [], []
        reports = []
        for _ in range(a.iterations):  # alternate, so both see the same machine
            reshard_s += timed(lambda: reports.append(r.refit()), 1)
            base_s += timed(base.refit, 1)
        # Both methods wrote the same buffers: compare them.
        same = True
        if rank in dst.ranks:
            got_base = {n: t.clone() for n, t in bufs.items()}
            for t in bufs.values():
                t.zero_()
            r.refit()
            for n in got_base:
                if not torch.equal(got_base[n], bufs[n]):
                    same = False
                    print(f"rank {rank}: {n} differs between reshard and the baseline", file=sys.stderr)
        else:
            r.refit()
        sent = torch.tensor([reports[-1]["bytes_moved"]], dtype=torch.int64)
        dist.all_reduce(sent)
        ok = torch.tensor([1 if same else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        r.close()
        dist.barrier()
        q.put((rank, "ok", reshard_s, base_s, int(sent.item()), bool(ok.item()), plan))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "crash", traceback.format_exc()))


def human(b):
    return f"{b / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32001)
    ap.add_argument("--train-tp", type=int, default=2)
    ap.add_argument("--infer-tp", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--fast", action="store_true", help="UCX fast data endpoint (CMA zero-copy; a dying peer aborts)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rank", type=int, help="run only this rank, in this process (one process per host, e.g. under "
                    "bench/netbed/netbed.py --each); rank 0 prints the results; needs --master")
    ap.add_argument("--master", help="with --rank: host:port of rank 0's TCPStore")
    ap.add_argument("--config-out", help="write the model's HuggingFace config to this file and exit")
    a = ap.parse_args()
    cfg = model_config(a)
    if a.config_out:
        with open(a.config_out, "w") as f:
            json.dump(cfg, f)
        return
    world = a.train_tp + a.infer_tp
    if a.rank is not None:
        return rank_main(a, cfg, world)
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with tempfile.TemporaryDirectory() as d:
        cfg_path = os.path.join(d, "config.json")
        json.dump(cfg, open(cfg_path, "w"))
        src = reshard.megatron_layout(cfg_path, f"tp={a.train_tp}")
        model_bytes = sum(2 * torch.Size(src.tensor(n)["shape"]).numel() for n in src.tensors)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, world, port, cfg_path, a, q)) for r in range(world)]
        for p in procs:
            p.start()
        res = {}
        for _ in range(world):
            x = q.get(timeout=1800)
            res[x[0]] = x
        for p in procs:
            p.join()
    report(a, res, model_bytes, world, "on loopback")


def rank_main(a, cfg, world):
    """One rank per process, started by something else (each in its own network host): rank 0 reports."""
    if not 0 <= a.rank < world:
        sys.exit(f"python_refit.py: --rank {a.rank} is not in 0..{world - 1} (train tp + infer tp)")
    if not a.master or ":" not in a.master:
        sys.exit(f"python_refit.py: --rank needs --master HOST:PORT (got {a.master!r})")
    host, port = a.master.rsplit(":", 1)
    # On a netbed host the network is NETBED_DEV (eth0); UCX over TCP only, gloo on the same interface.
    dev = os.environ.get("NETBED_DEV", "lo")
    os.environ.setdefault("UCX_TLS", "tcp,self")
    os.environ.setdefault("UCX_NET_DEVICES", dev)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", dev)
    with tempfile.TemporaryDirectory() as d:
        cfg_path = os.path.join(d, "config.json")
        json.dump(cfg, open(cfg_path, "w"))
        src = reshard.megatron_layout(cfg_path, f"tp={a.train_tp}")
        model_bytes = sum(2 * torch.Size(src.tensor(n)["shape"]).numel() for n in src.tensors)
        out = []
        worker(a.rank, world, int(port), cfg_path, a, type("Q", (), {"put": staticmethod(out.append)}), master=host)
    if out[0][1] != "ok":
        print(f"rank {a.rank} failed:\n{out[0][2]}", file=sys.stderr)
        sys.exit(1)
    if a.rank == 0:
        report(a, {0: out[0]}, model_bytes, world, f"one per host ({dev})")


def report(a, res, model_bytes, world, where):
    bad = [x for x in res.values() if x[1] != "ok"]
    if bad:
        for x in bad:
            print(f"rank {x[0]} failed:\n{x[2]}", file=sys.stderr)
        sys.exit(1)
    _, _, rs, bs, sent, same, plan = res[0]
    rm, bm = statistics.median(rs), statistics.median(bs)
    out = {"model_bytes": model_bytes, "train": f"megatron tp={a.train_tp}", "infer": f"vllm tp={a.infer_tp}", "processes": world,
           "reshard": {"seconds": rm, "iteration_seconds": rs, "bytes_moved": sent, "transport": "ucx",
                       "fast_data_endpoint": a.fast},
           "baseline": {"seconds": bm, "iteration_seconds": bs, "transport": "gloo", "bucket_mb": a.bucket_mb},
           "speedup": bm / rm, "validated": same, "plan": plan}
    if a.json:
        print(json.dumps(out))
        return
    print(f"model: Llama-like, {a.layers} layers, hidden {a.hidden}, {human(model_bytes)} of bf16; "
          f"Megatron tp={a.train_tp} -> vLLM tp={a.infer_tp}, {world} processes {where}")
    print(f"{'method':<44} {'median s':>9} {'GB/s':>6}   iterations (s)")
    for name, m, it in ((f"reshard (UCX{', fast data endpoint' if a.fast else ''})", rm, rs),
                        (f"torch.distributed gloo, {a.bucket_mb} MiB buckets", bm, bs)):
        print(f"{name:<44} {m:>9.3f} {model_bytes / m / 1e9:>6.2f}   {' '.join(f'{x:.3f}' for x in it)}")
    print(f"speedup {bm / rm:.2f}x; reshard moved {human(sent)} between processes (plan: {human(plan['bytes'])}); "
          f"destinations {'identical' if same else 'DIFFER'} between the two methods")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
