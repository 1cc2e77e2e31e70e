"""reshard as a vLLM weight-transfer backend (vLLM 0.33's ``vllm.distributed.weight_transfer``).

``import reshard.vllm`` registers a backend named ``"reshard"`` in vLLM's
``WeightTransferEngineFactory`` (the inference workers' side) and
``WeightTransferTrainerFactory`` (the trainer's side), changing nothing in
vLLM. A deployment switches to it with ``WeightTransferConfig(backend=
"reshard")`` on the engine and ``ReshardTrainerInitInfo`` on the trainer.

Phases (vLLM's four, plus the trainer's ``send_weights``):

* ``trainer_init`` (every trainer rank): the trainer's layout read from the
  ``WeightSource``'s metadata (each parameter's owners, mesh and ``Shard`` /
  ``Replicate`` placements, torch.chunk semantics: FSDP2, DTensor TP, plain
  modules), its local pieces (``iter_local()``) bound in place. The sender
  (rank 0) calls ``client.init_weight_transfer_engine`` with the store's
  address and the trainer's layout while every trainer rank sets up its end.
* ``init_transfer_engine`` (every vLLM rank): the destination layout traced
  through vLLM's own ``load_weights`` (:mod:`reshard.engines.vllm`), published,
  the plan compiled and the transport connected; all of it once.
* ``start_weight_update`` / ``update_weights`` (``receive_weights``): a refit
  straight into the live parameters, run by the trainer's ``send_weights`` on
  every trainer rank at the same time; fused, expert and padded parameters
  included; nothing is staged as a full tensor.
* ``finish_weight_update``: the version is published only when the refit
  committed on every rank (reshard's versioned commit); after a failed update
  it raises :class:`reshard.RefitNotCommitted` naming the stale tensors, and
  the engine refuses every later update (``failed``) until it is set up again.

Rendezvous: a ``torch.distributed.TCPStore`` that trainer rank 0 hosts
(``store_host`` / ``store_port``; port 0 picks a free one). Transport: UCX.
``delta=True`` on the trainer's init info makes every update a delta refit
(only the elements that changed since the last committed version move,
exactly; docs/delta.md). A trainer parameter whose float dtype differs from
vLLM's (an FSDP2 f32 master copy into a bf16 engine) is cast in flight as
vLLM's loader would (round to nearest even; the sender converts, so the
engine's dtype crosses the wire); not with ``delta``. Errors name reshard's
ranks: the trainer's ranks first, then the vLLM ranks (each message says
which are which).
Not supported yet: sources whose parameters are not plain placements (use
``reshard.Resharder`` with a layout, e.g. Megatron-Core's), quantized (FP8)
destinations through this backend, and parameters vLLM's loader computes
rather than copies (named at init).
"""
from __future__ import annotations

import datetime
import json
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, Replicate, Shard, TrainerInitInfo,
                                                   TrainerWeightTransferEngine, WeightTransferEngine,
                                                   WeightTransferInitInfo, WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from . import Error, Layout, RefitNotCommitted, Resharder, layout_from_json
from .engines.dtensor import placement_layout
from .engines.vllm import live_layout, reshard_dtype

BACKEND = "reshard"


def layout_from_param_meta(metas: List[ParamMeta], world_size: int, *, origin: str = "trainer layout") -> Layout:
    """The trainer's layout from vLLM's ``WeightSource.metadata``: one mesh (the owners' grid shared by
    every sharded parameter, or all ``world_size`` ranks), plain parameters replicated on it."""
    grid = None
    for m in metas:
        if m.owners is not None:
            g = (tuple(m.owners), tuple(m.mesh_shape))
            if grid is None:
                grid = g
            elif g != grid:
                raise Error(f"{origin}: parameter '{m.name}' is owned by ranks {g[0]} on mesh {g[1]}, others by "
                            f"{grid[0]} on {grid[1]}: one mesh per trainer is supported")
    owners, shape = grid if grid is not None else (tuple(range(world_size)), (world_size,))
    axes = [(f"mesh{i}", s) for i, s in enumerate(shape)]
    if grid is not None and len(owners) != world_size:
        plain = [m.name for m in metas if m.owners is None]
        if plain:
            raise Error(f"{origin}: '{plain[0]}' is on every rank but the mesh covers {len(owners)} of {world_size}")
    params = []
    for m in metas:
        pl = m.placements or tuple(Replicate() for _ in shape)
        params.append((m.name, list(m.shape), reshard_dtype(m.dtype),
                       [("shard", p.dim) if isinstance(p, Shard) else ("replicate", 0) for p in pl]))
    return placement_layout(params, axes, owners, origin=origin)


def rank_legend(trainer_world: int, vllm_world: int) -> str:
    """Which of reshard's ranks are whose, for error messages: the trainer's ranks come first."""
    def span(a, b):
        return f"{a}" if a == b else f"{a}-{b}"
    return (f"reshard ranks {span(0, trainer_world - 1)} are trainer ranks {span(0, trainer_world - 1)}, "
            f"{span(trainer_world, trainer_world + vllm_world - 1)} vLLM ranks {span(0, vllm_world - 1)}")


def _with_legend(e: Error, legend: str) -> Error:
    try:
        return type(e)(f"{e} [{legend}]")
    except TypeError:
        return Error(f"{e} [{legend}]")


# --- trainer side ---------------------------------------------------------------


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: ``rank`` (keyword) and the trainer's ``world_size``; where trainer rank 0
    hosts the store; the transport; refit time limits (seconds)."""
    backend: ClassVar[str] = BACKEND
    world_size: int = 1
    store_host: str = "127.0.0.1"
    store_port: int = 0
    prefix: str = "reshard-vllm"
    transport: str = "ucx"
    timeout: float = 300.0
    stall_timeout: float = 10.0
    delta: bool = False


class ReshardTrainerEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """Every trainer rank holds one; ``send_weights()`` refits the rollout engine from this rank's pieces."""
    init_info_cls = ReshardTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: Any, source: Any = None) -> "ReshardTrainerEngine":
        if source is None:
            raise Error("reshard trainer: give source= (a WeightSource: e.g. vLLM's ModuleSource(model))")
        self = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        info = init_info
        self.info = info
        self.version = 0
        self.src = layout_from_param_meta(source.metadata, info.world_size)
        self.buffers = {n: (t.detach() if getattr(t, "requires_grad", False) else t) for n, t in source.iter_local()
                        if any(b["name"] == n for b in self.src.buffers(info.rank))}
        if info.store_port == 0 and info.world_size > 1:
            raise Error("reshard trainer: with several trainer ranks give a fixed store_port (port 0 picks one "
                        "only rank 0 would know)")
        if self.is_sender:
            self.store = torch.distributed.TCPStore(info.store_host, info.store_port, None, True,
                                                    timeout=datetime.timedelta(seconds=info.timeout),
                                                    wait_for_workers=False)
            port = self.store.port
        else:
            port = info.store_port
            self.store = torch.distributed.TCPStore(info.store_host, port, None, False,
                                                    timeout=datetime.timedelta(seconds=info.timeout))
        worker_info = {"store_host": info.store_host, "store_port": port, "trainer_world": info.world_size,
                       "src_layout": self.src.to_json(), "prefix": info.prefix, "transport": info.transport,
                       "timeout": info.timeout, "stall_timeout": info.stall_timeout, "delta": info.delta}
        rpc = _Background(lambda: client.init_weight_transfer_engine(worker_info)) if self.is_sender else None
        try:
            dst = layout_from_json(self.store.get(f"{info.prefix}/dst_layout").decode(), "the vLLM engine's traced layout")
            self.legend = rank_legend(info.world_size, len(dst.ranks))
            self.resharder = Resharder(self.src, dst, rank=info.rank, buffers=self.buffers, transport=info.transport,
                                       store=self.store, prefix=info.prefix, timeout=info.timeout,
                                       stall_timeout=info.stall_timeout, delta=info.delta, cast=True)
        finally:
            if rpc:
                rpc.join()
        return self

    def _rebind(self) -> None:
        # A source may yield new tensors each round (a re-sharded or re-allocated parameter): copy
        # those into the memory bound at init rather than plan again.
        for n, t in self.source.iter_local():
            b = self.buffers.get(n)
            if b is not None and t.data_ptr() != b.data_ptr():
                b.copy_(t.detach().reshape(b.shape))

    def send_weights(self) -> None:
        """One update (every trainer rank at once): the sender (rank 0) drives the vLLM engines' phases
        while every rank runs its end of the refit. A failed refit raises naming the failed ranks, with
        what the engines answered; the engines then refuse to publish the version."""
        self._rebind()
        self.version += 1
        if self.is_sender:
            self.client.start_weight_update()
        rpc = _Background(lambda: self.client.update_weights({"version": self.version})) if self.is_sender else None
        failed: Optional[Error] = None
        try:
            self.last_report = self.resharder.refit()
        except Error as e:
            failed = e
        # The engines' answers are joined either way; the refit's error is the one that names the rank.
        engines = rpc.join_error() if rpc else None
        if failed is not None:
            raise _with_legend(failed, self.legend + (f"; the vLLM engines said: {engines}" if engines else "")) \
                from failed
        if engines is not None:
            raise engines
        if self.is_sender:
            self.client.finish_weight_update(str(self.version))

    def shutdown(self) -> None:
        r = getattr(self, "resharder", None)
        if r is not None:
            r.close()
            self.resharder = None


class _Background:
    """One control-plane call on a thread while this rank runs its side of a collective; join() re-raises."""

    def __init__(self, fn):
        self.error: Optional[BaseException] = None

        def run():
            try:
                fn()
            except BaseException as e:  # re-raised in join()
                self.error = e
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        e = self.join_error()
        if e is not None:
            raise e

    def join_error(self) -> Optional[BaseException]:
        self.thread.join()
        return self.error


# --- inference (vLLM worker) side ------------------------------------------------


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    store_host: str
    store_port: int
    trainer_world: int
    src_layout: str
    prefix: str = "reshard-vllm"
    transport: str = "ucx"
    timeout: float = 300.0
    stall_timeout: float = 10.0
    delta: bool = False


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    version: Optional[int] = None


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """A vLLM worker's end: refits straight into the model's live parameters."""
    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.resharder: Optional[Resharder] = None
        self.version: Optional[int] = None   #: the published version
        self.pending: Optional[int] = None
        self.failed: Optional[str] = None    #: why the engine refuses updates
        self.live = None
        self.last_report: Optional[dict] = None

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        info = init_info
        if str(self.device) != "cpu":
            raise Error(f"reshard backend: device {self.device}: this build moves host memory only")
        store = torch.distributed.TCPStore(info.store_host, info.store_port, None, False,
                                           timeout=datetime.timedelta(seconds=info.timeout))
        src = layout_from_json(info.src_layout, "the trainer's layout")
        ckpt = [(t["name"], t["shape"]) for t in json.loads(info.src_layout)["tensors"]]
        live = live_layout(self.model, ckpt, first_rank=info.trainer_world)
        if live.untraced:
            raise Error("reshard backend: vLLM's loader computes these parameters rather than copying them, so "
                        f"this backend cannot refit them in place yet: {', '.join(sorted(live.untraced))}")
        if live.rank == info.trainer_world:
            store.set(f"{info.prefix}/dst_layout", live.to_json())
        self.live = live
        self.legend = rank_legend(info.trainer_world, len(live.layout.ranks))
        self.resharder = Resharder(src, live.layout, rank=live.rank, buffers=live.buffers, transport=info.transport,
                                   store=store, prefix=info.prefix, timeout=info.timeout,
                                   stall_timeout=info.stall_timeout, delta=info.delta, cast=True)
        self.failed = None

    def start_weight_update(self) -> None:
        if self.resharder is None:
            raise Error("reshard backend: start_weight_update before init_transfer_engine")
        if self.failed:
            raise Error(f"reshard backend: refusing updates: {self.failed}")

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        self.start_weight_update()
        self.pending = update_info.version
        try:
            self.last_report = self.resharder.refit()
        except Error as e:
            self.pending = None
            self.failed = (f"the update to version {update_info.version} failed, parameters are stale: {e} "
                           f"[{self.legend}]")
            raise _with_legend(e, self.legend) from e

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        # vLLM's default synchronizes torch.accelerator afterwards, which initialises CUDA even for a
        # CPU model; a host refit has nothing left in flight when refit() returns.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        if self.failed:
            raise RefitNotCommitted(f"reshard backend: not published: {self.failed}")
        if self.pending is None:
            raise Error("reshard backend: finish_weight_update without a received update")
        self.version, self.pending = self.pending, None

    def shutdown(self) -> None:
        if self.resharder is not None:
            self.resharder.close()
            self.resharder = None


def register() -> None:
    """Registers the backend in both factories (idempotent): importing this module does it, and so does
    vLLM's plugin loader in each process it starts (the package's ``vllm.general_plugins`` entry point)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ReshardWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, ReshardTrainerEngine)


register()
