"""The trainer's side of the backend: ``ReshardTrainerEngine`` on every trainer rank, driving the vLLM
engines' phases from rank 0 while every rank runs its end of each refit."""
from __future__ import annotations

import datetime
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import vllm
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from .. import Error, Layout, Resharder, layout_from_json
from ..engines.rows import split_rows
from .checks import check_vllm_version, layout_from_param_meta, rank_legend, with_legend
from .coordination import (
    Background,
    SetupStore,
    TransferSettings,
    await_engines,
    drop_resharder,
    gather_bytes,
    log_phase,
    publish_bytes,
    publish_error,
    update_report,
)
from .lifecycle import REBIND

BACKEND = "reshard"
log = logging.getLogger("reshard")


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo, TransferSettings):
    """The trainer's side: ``rank`` (keyword) and the trainer's ``world_size``; where trainer rank 0
    hosts the store (a fixed ``store_port`` with several trainer ranks); and the :class:`TransferSettings`
    (keywords), passed on to the engines."""
    backend: ClassVar[str] = BACKEND
    world_size: int = 1
    store_host: str = "127.0.0.1"
    store_port: int = 0


def source_layout(source: Any, world_size: int, rank: int) -> "tuple[Layout, dict]":
    """The trainer's layout and this rank's buffers: from a source bound to its own reshard layout
    (``reshard.engines.megatron.MegatronSource``: ``layout`` and ``buffers(rank)``), or from a vLLM
    ``WeightSource``'s metadata (plain and DTensor parameters) and its ``iter_local()``."""
    if isinstance(getattr(source, "layout", None), Layout):
        if len(source.layout.ranks) != world_size:
            raise Error(f"reshard trainer: the source's layout ({source.layout.origin}) has "
                        f"{len(source.layout.ranks)} ranks, the trainer world_size is {world_size}")
        return source.layout, source.buffers(rank)
    src = layout_from_param_meta(source.metadata, world_size)
    mine = {b["name"] for b in src.buffers(rank)}  # once: a lookup per parameter stays O(1)
    return src, {n: (t.detach() if getattr(t, "requires_grad", False) else t)
                 for n, t in source.iter_local() if n in mine}


class ReshardTrainerEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """Every trainer rank holds one; ``send_weights()`` refits the rollout engine from this rank's pieces."""
    init_info_cls = ReshardTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: Any, source: Any = None) -> "ReshardTrainerEngine":
        if source is None:
            raise Error("reshard trainer: give source= (a WeightSource: vLLM's ModuleSource(model), or "
                        "reshard.engines.megatron.MegatronSource(model, config, spec) for a Megatron-Core GPTModel)")
        info = init_info
        if info.store_port == 0 and info.world_size > 1:
            raise Error("reshard trainer: with several trainer ranks give a fixed store_port (port 0 picks one "
                        "only rank 0 would know)")
        self = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        self.info, self.version, self.round, self.resharder, self.last_report = info, 0, 0, None, None
        self.attempts = 0  # start_weight_update calls, refused ones included (each its own store key)
        self.failed = False  # an update failed since the last setup
        self.rebinding = False  # setting up again because the engines asked for a new binding
        timeout = datetime.timedelta(seconds=info.timeout)
        if self.is_sender:
            self.store = torch.distributed.TCPStore(info.store_host, info.store_port, None, True, timeout=timeout,
                                                    wait_for_workers=False)
        else:
            self.store = torch.distributed.TCPStore(info.store_host, info.store_port, None, False, timeout=timeout)
        t0 = time.monotonic()
        try:
            check_vllm_version(vllm.__version__)
            self.src, self.buffers = source_layout(source, info.world_size, info.rank)
        except BaseException as e:
            publish_error(self.store, f"{self.prefix}/setup_error", f"trainer rank {info.rank}: {e}")
            raise
        log_phase(f"trainer rank {info.rank}: layout of {len(self.src.tensors)} parameters from the source", t0)
        self._set_up()
        return self

    @property
    def prefix(self) -> str:
        """This setup round's store prefix (a repair starts a new round on the same store)."""
        return f"{self.info.prefix}/{self.round}"

    def _set_up(self) -> None:
        """Every trainer rank: the sender starts the engines' setup; all wait for their layout (as long as
        they beat) and set up their end. A failure here is published for every other rank."""
        info, t0 = self.info, time.monotonic()
        error_key = f"{self.prefix}/setup_error"
        worker_info = {**info.settings(), "store_host": info.store_host, "store_port": self.store.port,
                       "trainer_world": info.world_size, "src_layout": self.src.to_json(), "prefix": self.prefix}
        rpc = Background(lambda: self.client.init_weight_transfer_engine(worker_info)) if self.is_sender else None
        try:
            dst = layout_from_json(await_engines(self.store, self.prefix, first_beat=info.timeout,
                                                 silence=info.stall_timeout, rpc=rpc, rank=info.rank),
                                   "the vLLM engine's traced layout")
            t0 = log_phase(f"trainer rank {info.rank}: the engines traced their layout", t0)
            self.legend = rank_legend(info.world_size, len(dst.ranks))
            # Rows of fused checkpoint tensors that the engine holds apart: ranges of their own on both sides.
            self.resharder = Resharder(split_rows(self.src, dst), dst, rank=info.rank, buffers=self.buffers,
                                       transport=info.transport,
                                       store=SetupStore(self.store, error_key), prefix=self.prefix,
                                       timeout=info.timeout, stall_timeout=info.stall_timeout, delta=info.delta,
                                       cast=True)
            log_phase(f"trainer rank {info.rank}: plan, transport and memory set up", t0)
        except BaseException as e:
            publish_error(self.store, error_key, f"trainer rank {info.rank}: {e}")
            if rpc:
                rpc.thread.join(timeout=info.stall_timeout)  # the engines fail too: they read the same key
            raise
        if rpc:
            rpc.join()

    def repair(self, client: Any = None) -> dict:
        """After a failed update, on every surviving trainer rank at once: sets the transfer up again with
        the engines behind ``client`` (new rollout actors when a vLLM rank died; the same ones after a
        transient fault) and sends the current weights in one dense update, published when it commits.
        Returns that update's report. (A trainer rank that died: the restarted trainer's ``trainer_init``
        repairs the surviving engines the same way, its first ``send_weights`` being dense.)"""
        drop_resharder(self.resharder)
        self.resharder, self.failed = None, False
        if client is not None:
            self.client = client
        self.round += 1
        self._set_up()
        return self.send_weights()

    def _rebind(self) -> None:
        # A source may yield new tensors each round (a re-sharded or re-allocated parameter): copy
        # those into the memory bound at init rather than plan again.
        for n, t in self.source.iter_local():
            b = self.buffers.get(n)
            if b is not None and t.data_ptr() != b.data_ptr():
                b.copy_(t.detach().reshape(b.shape))

    def _agree_to_start(self, version: int) -> None:
        """The sender starts the engines' update; every trainer rank learns whether they accepted it before
        its refit (a refused update would otherwise leave the others waiting in the refit)."""
        key = f"{self.prefix}/start/{version}/{self.attempts}"
        self.attempts += 1
        if self.is_sender:
            try:
                self.client.start_weight_update()
            except BaseException as e:
                self.store.set(key, f"refused: {e}".encode())
                raise
            self.store.set(key, b"ok")
            return
        self.store.wait([key], datetime.timedelta(seconds=self.info.timeout))
        said = self.store.get(key).decode()
        if said != "ok":
            raise Error(f"reshard trainer rank {self.rank}: the engines {said}")

    def send_weights(self) -> dict:
        """One update (every trainer rank at once): the sender (rank 0) drives the vLLM engines' phases
        while every rank runs its end of the refit. Returns the update's report: ``version``, ``seconds``,
        ``mode`` (``dense`` or the delta refit's mode), this rank's ``bytes_sent``, and on the sender
        ``rank_bytes`` (every reshard rank's bytes sent and received) and ``bytes`` (their sum sent). A
        failed refit raises naming the failed ranks, with what the engines answered; the engines then
        refuse to publish the version."""
        if self.resharder is None:
            raise Error(f"reshard trainer rank {self.rank}: not set up (a failed setup or update: repair() it)")
        self._rebind()
        try:
            self._agree_to_start(self.version + 1)
        except Exception as e:  # the client's error type is the deployment's (a Ray actor's: RayTaskError)
            if REBIND not in str(e) or self.rebinding:
                raise
            log.info("reshard: trainer rank %d: the engines need a new binding, setting up again: %s", self.rank, e)
            self.rebinding = True  # once: an engine that still refuses after a new setup is an error
            try:
                return self.repair()
            finally:
                self.rebinding = False
        self.version += 1
        rpc = Background(lambda: self.client.update_weights({"version": self.version})) if self.is_sender else None
        failed: Optional[Error] = None
        try:
            rep = self.resharder.refit()
        except Error as e:
            failed = e
        # The engines' answers are joined either way; the refit's error is the one that names the rank.
        engines = rpc.join_error() if rpc else None
        if failed is not None:
            self.failed = True
            raise with_legend(failed, self.legend + (f"; the vLLM engines said: {engines}" if engines else "")) \
                from failed
        if engines is not None:
            raise engines
        self.last_report = update_report(rep, self.version)
        publish_bytes(self.store, self.prefix, self.version, rep)
        if self.is_sender:
            self.client.finish_weight_update(str(self.version))
            self.last_report.update(gather_bytes(self.store, self.prefix, self.version, len(self.resharder.world),
                                                 self.info.stall_timeout))
        return self.last_report

    def shutdown(self) -> None:
        r = getattr(self, "resharder", None)
        self.resharder = None
        if getattr(self, "failed", False):
            drop_resharder(r)  # its peers may be gone: no collective close
        elif r is not None:
            r.close()
        del r
        self.release_store()

    def release_store(self) -> None:
        """Lets go of the store; on rank 0, which hosts it, that closes its listening socket and frees the
        port (nothing else holds the store once the Resharder is gone)."""
        store = getattr(self, "store", None)
        self.store = None
        del store
        gc.collect()  # a Resharder's reference cycle may still hold the store client
