"""The actors of examples/python/vllm_rl_loop.py: FSDP2 trainer ranks, live vLLM rollout ranks, and the
client through which trainer rank 0 drives the rollout engines' phases (vLLM's weight-sync client
protocol over Ray). Each actor also keeps the peer path (vLLM's ``nccl`` backend's broadcast +
``load_weights``, on gloo) and the checks of its own memory; the loop that drives them is in
vllm_rl_loop.py.
"""
from __future__ import annotations

import datetime
import math
import os
import pathlib
import signal
import socket
import time

import ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RolloutClient:
    """vLLM's weight-sync client protocol over Ray: each call runs on every rollout actor and waits for
    all of them; a failure names each actor that failed or died."""

    def __init__(self, rollouts):
        self.rollouts = rollouts
        self.skip_finish = 0  # a client that forgets finish_weight_update of this version (a test)

    def call(self, method, *args):
        refs = [getattr(a, method).remote(*args) for a in self.rollouts]
        errors = []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                errors.append(f"rollout actor {i} (vLLM rank {i}) died")
            except ray.exceptions.RayTaskError as e:
                errors.append(f"rollout actor {i}: {e.cause if e.cause is not None else e}")
        if errors:
            import reshard
            raise reshard.Error(f"{method}: " + "; ".join(errors))

    def init_weight_transfer_engine(self, init_info):
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self.call("start_weight_update")

    def update_weights(self, update_info):
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        if weight_version is not None and int(weight_version) == self.skip_finish:
            return
        self.call("finish_weight_update")


class Trainer:
    """One rank of an FSDP2 trainer (gloo) and its end of the weight transfer."""

    def __init__(self, rank, world, cfg, master_port, seed, lr, optimizer, kill_at, master_f32, weights=None):
        self.join(rank, world, cfg, master_port)
        from reshard.engines.cpu import fsdp_model
        self.model = fsdp_model(cfg, ray.get(weights[0]) if weights else None, seed=seed, master_f32=master_f32)
        self.opt = self.optimizer(optimizer, lr)
        self.gen = self.torch.Generator().manual_seed(1000 + rank)
        self.kill_at = kill_at

    def join(self, rank, world, cfg, master_port):
        """This actor as rank ``rank`` of the trainer's gloo group (joined when the model is built)."""
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
        import torch
        self.torch, self.rank, self.world, self.cfg, self.engine = torch, rank, world, cfg, None

    def optimizer(self, name, lr):
        return {"sgd": self.torch.optim.SGD, "adam": self.torch.optim.Adam}[name](self.model.parameters(), lr=lr)

    def source(self):
        """What the backend's trainer_init binds: vLLM's ModuleSource over the FSDP2 model."""
        from vllm.distributed.weight_transfer.base import ModuleSource
        return ModuleSource(self.model)

    def full_tensors(self):
        """The full state dict, HF name -> tensor, on rank 0 (None elsewhere): a collective of every rank."""
        full = {n: p.full_tensor() for n, p in self.model.named_parameters()}
        return full if self.rank == 0 else None

    def ready(self):
        return True

    def listen_port(self):
        return free_port()

    def init_transfer(self, store_port, rollouts, delta, transactional=False):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        import reshard.vllm as rv

        t0 = time.monotonic()
        self.client = RolloutClient(rollouts)
        self.rollouts = rollouts
        try:
            self.engine = WeightTransferTrainerFactory.trainer_init(
                rv.ReshardTrainerInitInfo(rank=self.rank, world_size=self.world, store_port=store_port, delta=delta,
                                          stall_timeout=STALL_TIMEOUT, transactional=transactional),
                client=self.client, source=self.source())
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
        return {"seconds": time.monotonic() - t0}

    def skip_next_finish(self):
        """The client forgets the next update's finish_weight_update (a test of the phases)."""
        self.client.skip_finish = self.engine.version + 1

    def repair(self, rollouts=None):
        """After a failed update: the transfer set up again (with new rollout actors, when given) and the
        current weights sent dense. (seconds, the update's report) or the error."""
        t0 = time.monotonic()
        client = None
        if rollouts is not None:
            client = RolloutClient(rollouts)
            self.rollouts = rollouts
        try:
            rep = self.engine.repair(client)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
        return {"seconds": time.monotonic() - t0, "mode": rep["mode"], "version": rep["version"]}

    def train_step(self):
        ids = self.torch.randint(0, self.cfg["vocab_size"], (2, 16), generator=self.gen)
        loss = self.model(input_ids=ids).logits.float().pow(2).mean()  # a toy objective, a real step
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()

    def full_state(self):
        """The full state dict (a collective of every trainer rank); rank 0 puts it in Ray's store."""
        full = self.full_tensors()
        return [ray.put(full)] if full is not None else None

    def send(self):
        """One update through the backend: (seconds, bytes this rank sent) or the error."""
        if self.kill_at and self.engine.version + 1 == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash at the start of an update
        t0 = time.monotonic()
        try:
            rep = self.engine.send_weights()
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
        return {"seconds": time.monotonic() - t0, "bytes": rep["bytes_sent"], "mode": rep["mode"],
                "version": rep["version"], "rank_bytes": rep.get("rank_bytes")}

    def peer_init(self, port, rollouts):
        self.rollouts = rollouts
        if self.rank != 0:
            return
        refs = [r.peer_init.remote(port, i + 1, len(rollouts) + 1) for i, r in enumerate(rollouts)]
        self.peer = peer_group(port, 0, len(rollouts) + 1, host=True)
        ray.get(refs)

    def peer_send(self, packed=True, block=None):
        """vLLM's nccl backend's path on gloo: the trainer gathers the full tensors on rank 0 (FSDP2's
        full_tensor; Megatron's export), which broadcasts them to every rollout rank, which loads them with
        load_weights inside vLLM's layerwise reload. ``packed`` (vLLM 0.33's default): 1 GB buckets, two in
        flight; else one tensor at a time. ``block``: block-FP8 engines: rank 0 quantizes the full tensors
        first (the reference quantizer) and sends weights and scales."""
        from reshard.engines.fp8 import reference_checkpoint
        t0 = time.monotonic()
        full = self.full_tensors()
        if full is None:
            return None
        full = list(full.items() if block is None else reference_checkpoint(full.items(), block))
        meta = [(n, list(t.shape), str(t.dtype).split(".")[-1]) for n, t in full]
        refs = [r.peer_receive.remote(meta, packed) for r in self.rollouts]
        if packed:
            packed_broadcast(self.peer, iter(full))
        else:
            for _, t in full:
                self.peer.broadcast(on_wire(t), 0).wait()
        ray.get(refs)
        return {"seconds": time.monotonic() - t0, "bytes": sum(t.numel() * t.element_size() for _, t in full)
                * len(self.rollouts)}

    def close(self):
        if self.engine is not None:
            self.engine.shutdown()


#: Seconds without progress before a refit's wait gives up (the backend's stall_timeout): short, so that a
#: stalled rank fails the update in seconds.
STALL_TIMEOUT = 4.0


def on_wire(t):
    """A tensor as gloo sends it: FP8 (which gloo does not know) as its bytes."""
    import torch
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def packed_broadcast(group, tensors):
    """vLLM 0.33's packed_nccl_broadcast_producer on gloo: its own pack_tensors fills each bucket (past
    DEFAULT_PACKED_BUFFER_SIZE_BYTES it is sent) while up to DEFAULT_PACKED_NUM_BUFFERS broadcasts are in
    flight; gloo's work handles stand for its CUDA streams."""
    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS,
        pack_tensors,
    )
    in_flight = [None] * DEFAULT_PACKED_NUM_BUFFERS
    slot = 0
    while True:
        if in_flight[slot] is not None:
            in_flight[slot][0].wait()  # the slot's last broadcast has left: its bucket may go
            in_flight[slot] = None
        chunk = pack_tensors(tensors, lambda item: item[1], DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        if chunk is None:
            break
        in_flight[slot] = (group.broadcast(chunk.packed_tensor, 0), chunk)
        slot = (slot + 1) % DEFAULT_PACKED_NUM_BUFFERS
    for f in in_flight:
        if f is not None:
            f[0].wait()


def packed_receive(group, meta, load):
    """vLLM 0.33's packed_nccl_broadcast_consumer on gloo: buckets cut by the same sizes as the producer's,
    each received whole, split by its own unpack_tensor and handed to ``load``."""
    import torch
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES, unpack_tensor
    bucket, size = [], 0

    def receive():
        packed = torch.empty(size, dtype=torch.uint8)
        group.broadcast(packed, 0).wait()
        names, shapes, dtypes, sizes = zip(*bucket)
        load(unpack_tensor(packed, list(names), list(shapes), list(dtypes), list(sizes)))

    for name, shape, dtype in meta:
        dt = getattr(torch, dtype)
        nbytes = math.prod(shape) * dt.itemsize
        bucket.append((name, shape, dt, nbytes))
        size += nbytes
        if size > DEFAULT_PACKED_BUFFER_SIZE_BYTES:
            receive()
            bucket, size = [], 0
    if bucket:
        receive()


def peer_group(port, rank, size, host=False):
    import torch
    store = torch.distributed.TCPStore("127.0.0.1", port, size, host, timeout=datetime.timedelta(seconds=120))
    return torch.distributed.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=300))


class Restreamed:
    """A checkpoint read as a stream as often as it is asked for (LoadedTwin reads it twice): a quantized
    copy of the whole model is never held (at 1 GB and tp=4, four of them broke the machine's memory)."""

    def __init__(self, stream):
        self.stream = stream

    def items(self):
        return self.stream()


class Rollout:
    """One rank of a vLLM engine (CPU recipe) and the engine the "reshard" backend gives it."""

    def __init__(self, rank, tp, cfg, master_port, work, expert_parallel, kill_at, stall_at=0):
        from reshard.engines import cpu
        work = pathlib.Path(work)
        os.environ.update(cpu.vllm_env(work / f"rollout{rank}"), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank))
        import torch
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        import reshard.vllm  # noqa: F401  registers the backend (so does vLLM's plugin loader)
        from reshard.engines import fp8
        self.torch, self.cpu, self.rank, self.kill_at, self.stall_at = torch, cpu, rank, kill_at, stall_at
        self.fp8, self.block = fp8, fp8.block_of(cfg)
        self.model, self.vcfg = cpu.vllm_model(cpu.vllm_model_dir(cfg, work / "model-dir" / str(rank)), tp,
                                               expert_parallel=expert_parallel)
        self.engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="reshard"), self.vcfg,
                                                                torch.device("cpu"), self.model)
        self.twin, self.junk, self.missed_write, self.fp8_fault = None, "never", None, 0

    def reference(self, full_ref, junk):
        """The check's twin model (vLLM's loader's reference), and when the live parameters are set to junk
        before an update: ``every`` update, the ``first`` one, or ``never``."""
        self.twin = self.cpu.LoadedTwin(self.model, self.vcfg, Restreamed(lambda: self.checkpoint(full_ref)))
        self.junk = junk

    def checkpoint(self, full_ref):
        """What vLLM's loader reads for a trainer's full state: the state itself, or for a block-FP8 engine the
        FP8 checkpoint the reference quantizer makes of it."""
        full = ray.get(full_ref[0]).items()
        return full if self.block is None else self.fp8.reference_checkpoint(full, self.block)

    def plant_missed_write(self, version, row):
        """A planted fault: in that version's update, row ``row`` of this rank's embed_tokens keeps what it
        held before (a write the refit missed)."""
        self.missed_write = (version, row)

    def plant_fp8_faults(self, version):
        """Planted faults in a block-FP8 engine: after that version's update, one scale entry of this rank's
        first quantized projection is one ulp off, and the first tile of its second one holds the FP8 codes
        of the tile below it (a tile quantized from the wrong rows)."""
        self.fp8_fault = version

    def _corrupt_fp8(self):
        params = dict(self.model.named_parameters())
        scales = [n for n in params if n.endswith("weight_scale_inv")]
        if len(scales) < 2:
            raise RuntimeError("--plant-fp8-faults: the engine has fewer than two quantized projections")
        torch, (br, _) = self.torch, self.block
        with torch.no_grad():
            params[scales[0]].detach().view(torch.int32).view(-1)[0] += 1  # the next float up: one ulp
            w = params[scales[1][: -len("_scale_inv")]].detach().view(torch.uint8)
            if w.shape[0] < 2 * br:
                raise RuntimeError(f"--plant-fp8-faults: '{scales[1]}' has fewer than two row tiles here")
            w[:br, :br] = w[br:2 * br, :br].clone()

    def ready(self):
        return True

    # The engine's phases, called by trainer rank 0's RolloutClient.
    def init_weight_transfer_engine(self, init_info):
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self):
        if self.junk != "never":
            self.twin.junk_fill()
            self.junk = "never" if self.junk == "first" else self.junk
        self.engine.start_weight_update()

    def update_weights(self, update_info):
        if self.kill_at and update_info.get("version") == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash in the middle of an update
        if self.stall_at and update_info.get("version") == self.stall_at:
            time.sleep(STALL_TIMEOUT + 2)  # a transient fault: the peers give up on this rank, which lives on
        missed = self.missed_write and self.missed_write[0] == update_info.get("version")
        if missed:
            row = self.model.model.embed_tokens.weight.detach()[self.missed_write[1]]
            before = row.clone()
        self.engine.update_weights(update_info)
        if self.fp8_fault and self.fp8_fault == update_info.get("version"):
            self._corrupt_fp8()
        if missed:
            with self.torch.no_grad():
                row.copy_(before)

    def finish_weight_update(self):
        self.engine.finish_weight_update()

    def check(self, full_ref, version):
        """Every parameter against vLLM's own load_weights of the trainer's full state dict into the twin;
        ``held``: the bytes that load writes from the checkpoint on this rank."""
        assert self.engine.version == version, f"published version {self.engine.version}, expected {version}"
        bad = self.twin.differences(self.checkpoint(full_ref))
        if bad:
            raise AssertionError(f"vLLM rank {self.rank}, version {version}: {len(bad)} parameters differ from "
                                 f"vLLM's loader: {bad[:4]}")
        return {"received": self.engine.last_report["bytes_received"], "held": self.twin.checkpoint_bytes(),
                "parameters": len(list(self.model.parameters()))}

    def state(self):
        return {"version": self.engine.version, "failed": self.engine.failed}

    def failure_check(self, new_ref, old_ref):
        """The engine's report of a failed update against this rank's memory: each parameter compared, element
        by element, with what vLLM's loader makes of the failed version (`new_ref`) and of the last published
        one (`old_ref`). Returns the report's counts and every parameter the report misnames."""
        f = self.engine.failure
        held = self.cpu.what_parameters_hold(self.model, self.checkpoint(new_ref), self.checkpoint(old_ref))
        named = {n: k for k in ("written", "partial", "untouched") for n in f[k]}
        # A parameter named partial may hold either version whole (a receive posted, not landed or landed
        # entirely); one whose two versions agree ("same") may be named anything.
        wrong = [f"{n}: named {named.get(n)}, holds {h}" for n, h in held.items() if named.get(n) != h
                 and h != "same" and not (named.get(n) == "partial" and h in ("written", "untouched"))]
        return {k: len(f[k]) for k in ("written", "partial", "untouched")} | {"misnamed": wrong,
                                                                            "parameters": len(held)}

    def trace_seconds(self):
        """How long init_transfer_engine's trace of vLLM's loader took here."""
        return self.engine.live.seconds

    def peer_init(self, port, rank, size):
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        self.peer = peer_group(port, rank, size)
        # The layerwise reload re-runs each layer's process_weights_after_loading, which for routed experts is
        # the CPU prepack the CUDA wheel lacks (shared/ENGINES.md): MoE models load without it here.
        self.layerwise = not any(isinstance(m, RoutedExperts) for m in self.model.modules())
        if self.layerwise:
            record_metadata_for_reloading(self.model)  # as vLLM's loader does after its first load

    def peer_receive(self, meta, packed):
        """vLLM's nccl engine: load_weights inside the layerwise reload (start_weight_update /
        finish_weight_update), the weights packed or one tensor at a time."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        torch = self.torch

        def arriving():
            for name, shape, dtype in meta:
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                self.peer.broadcast(on_wire(t), 0).wait()
                yield name, t
        if self.layerwise:
            initialize_layerwise_reload(self.model)
        if packed:
            packed_receive(self.peer, meta, lambda weights: self.cpu.vllm_load(self.model, weights))
        else:
            self.cpu.vllm_load(self.model, arriving())
        if self.layerwise:
            finalize_layerwise_reload(self.model, self.vcfg.model_config)

    def close(self):
        self.engine.shutdown()
