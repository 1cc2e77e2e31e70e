"""The inference side of the backend: ``ReshardWeightTransferEngine`` in each vLLM worker, refitting
straight into the model's live parameters, and what a failed update left there."""
from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import vllm
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from .. import Error, RefitNotCommitted, Resharder, layout_from_json
from ..engines.fp8 import block_of, quantized_live_layout
from ..engines.rows import split_rows
from ..engines.vllm import live_layout
from .checks import check_parallel_config, check_vllm_version, config_differences, rank_legend, untraced_error, with_legend
from .coordination import (
    Heartbeat,
    SetupStore,
    TransferSettings,
    drop_resharder,
    log_phase,
    publish_bytes,
    publish_error,
    raise_published,
    update_report,
)
from .lifecycle import REBIND, Fingerprint, SleepState, binding_change, fingerprints

log = logging.getLogger("reshard")


@dataclass
class ReshardInitInfo(WeightTransferInitInfo, TransferSettings):
    """What the trainer sends the engines: where its store is, its world and layout, and its
    :class:`TransferSettings` (keywords; ``prefix`` is this setup round's)."""
    store_host: str
    store_port: int
    trainer_world: int
    src_layout: str


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    version: Optional[int] = None


def vllm_rank() -> Tuple[int, int]:
    """This process's rank in vLLM's world and its size (0, 1 outside torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """A vLLM worker's end: refits straight into the model's live parameters.

    ``version``: the published version. ``failure``: after a failed update, what this rank's parameters
    hold (``version``, ``error``, ``written``, ``partial``, ``untouched``, ``published``: the last
    published version) until a repair's update commits; ``failed`` says it in words."""
    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.resharder: Optional[Resharder] = None
        self.version: Optional[int] = None   #: the published version
        self.pending: Optional[int] = None   #: the version received and not yet published
        self.started = False                 #: start_weight_update called, the update not finished
        self.failure: Optional[dict] = None
        self.repaired = False                #: set up again since the failure: the next commit clears it
        self.live = None
        self.last_report: Optional[dict] = None
        self.store: Any = None
        self.bound: Dict[str, Fingerprint] = {}  #: each bound parameter's storage, shape, dtype, device
        self.sleep_state = SleepState()

    @property
    def failed(self) -> Optional[str]:
        """Why the engine refuses updates (None when it does not)."""
        return None if self.failure is None else self.failure["text"]

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        """Sets the transfer up (again, after a failure: a repair). Any error is published on the store
        for every other rank before it is raised here."""
        info = init_info
        vrank, vworld = vllm_rank()
        self.close_endpoint()
        store = torch.distributed.TCPStore(info.store_host, info.store_port, None, False,
                                           timeout=datetime.timedelta(seconds=info.timeout))
        error_key = f"{info.prefix}/setup_error"
        store.set(f"{info.prefix}/engines", str(vworld))
        beat = Heartbeat(info.store_host, info.store_port, f"{info.prefix}/beat/{vrank}", info.timeout)
        try:
            self._set_up(info, store, error_key)
        except BaseException as e:
            publish_error(store, error_key, f"vLLM rank {vrank}: {e}")
            raise
        finally:
            beat.stop()
        self.started, self.pending = False, None
        self.repaired = self.failure is not None
        self.bound = fingerprints(self.live.bound_parameters())
        self.sleep_state.bound_anew()

    def close_endpoint(self) -> None:
        """Frees the last setup's Resharder (its transport and memory registrations; no collective close:
        a re-init's peers set up anew) and lets go of its store client and bound parameters."""
        r, self.resharder = self.resharder, None
        drop_resharder(r)
        self.store, self.live, self.staging, self.bound = None, None, None, {}

    def _set_up(self, info: ReshardInitInfo, store: Any, error_key: str) -> None:
        if str(self.device) != "cpu":
            raise Error(f"reshard backend: device {self.device}: this build moves host memory only")
        check_vllm_version(vllm.__version__)
        check_parallel_config(self.vllm_config.parallel_config)
        t0 = time.monotonic()
        raise_published(store, error_key)  # a trainer rank that failed first
        src = layout_from_json(info.src_layout, "the trainer's layout")
        ckpt = [(t["name"], t["shape"]) for t in json.loads(info.src_layout)["tensors"]]
        differences = config_differences(ckpt, self.model_config.hf_config)
        if differences:
            raise Error(untraced_error([], [n for n, _ in ckpt], differences))
        dtypes = [(t["name"], t["shape"], t["dtype"]) for t in json.loads(info.src_layout)["tensors"]]
        block = block_of(self.model_config.hf_config)
        if block is None:
            live = live_layout(self.model, dtypes, first_rank=info.trainer_world)
        else:  # quantized in flight into vLLM's FP8 parameters and their scales
            live = quantized_live_layout(self.model, dtypes, block, act_dtype=self.model_config.dtype,
                                         first_rank=info.trainer_world)
        if live.untraced:
            raise Error(untraced_error(list(live.untraced), [n for n, _ in ckpt], []))
        t0 = log_phase(f"vLLM rank {live.rank - info.trainer_world}: layout traced through vLLM's loader", t0)
        if live.rank == info.trainer_world:
            store.set(f"{info.prefix}/dst_layout", live.to_json())
        self.live = live
        self.legend = rank_legend(info.trainer_world, len(live.layout.ranks))
        buffers, self.staging = live.buffers, None
        if info.transactional:
            # Updates land in a copy of this rank's parameters, copied into the live ones at
            # finish_weight_update: a failed update leaves them untouched. Memory: one more copy of what
            # this rank holds, nothing of the others'.
            self.staging = {n: t.clone() for n, t in live.buffers.items()}
            buffers = self.staging
            log.info("reshard: vLLM rank %d: transactional updates: %.1f MB of staging", live.rank - info.trainer_world,
                     sum(t.numel() * t.element_size() for t in buffers.values()) / 1e6)
        self.resharder = Resharder(split_rows(src, live.layout), live.layout, rank=live.rank, buffers=buffers,
                                   transport=info.transport,
                                   store=SetupStore(store, error_key), prefix=info.prefix, timeout=info.timeout,
                                   stall_timeout=info.stall_timeout, delta=info.delta, cast=True)
        self.store, self.prefix = store, info.prefix
        log_phase(f"vLLM rank {live.rank - info.trainer_world}: plan, transport and memory set up", t0)

    def start_weight_update(self) -> None:
        if self.resharder is None:
            raise Error("reshard backend: start_weight_update before init_transfer_engine"
                        + (f" (the failed update left: {self.failed})" if self.failure else ""))
        if self.failure is not None and not self.repaired:
            raise Error(f"reshard backend: refusing updates until repaired: {self.failed}")
        if self.started:
            raise Error("reshard backend: start_weight_update while the update "
                        + (f"to version {self.pending} was received and " if self.pending is not None else "")
                        + "not finished: call finish_weight_update first (it publishes the version or reports "
                        "its failure)")
        why = self.sleep_state.refusal() or self.sleep_state.rebind or binding_change(self.model, self.bound)
        if why:
            raise Error(f"reshard backend: update refused: {why}" + (
                " (the trainer sets the transfer up again, binding the memory the model uses now, and sends "
                "a dense update)" if REBIND in why else ""))
        self.started = True

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``sleep(level)`` on this worker: updates are refused until :meth:`wake_up`."""
        self.sleep_state.sleep(level)

    def wake_up(self, tags: Optional[List[str]] = None) -> None:
        """vLLM's ``wake_up(tags)`` on this worker: after level 1 the bindings are checked and kept (the
        weights are back where they were); after level 2 the next update re-binds and is dense."""
        self.sleep_state.wake_up(tags, self.model, self.bound)

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        if not self.started:
            self.start_weight_update()  # a client that does not call it (vLLM's own always does)
        if self.pending is not None:
            raise Error(f"reshard backend: version {self.pending} was received and not finished: call "
                        "finish_weight_update first")
        try:
            rep = self.resharder.refit()
        except Error as e:
            self.failure = failure_report(e, update_info.version, self.version, sorted(self.live.buffers),
                                          transactional=self.staging is not None)
            self.failure["text"] += f" [{self.legend}]"
            self.repaired = False
            raise with_legend(e, self.legend) from e
        self.pending = update_info.version
        self.last_report = update_report(rep, update_info.version)
        publish_bytes(self.store, self.prefix, update_info.version, rep)

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        # vLLM's default synchronizes torch.accelerator afterwards, which initialises CUDA even for a
        # CPU model; a host refit has nothing left in flight when refit() returns.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        if self.failure is not None and (not self.repaired or self.pending is None):
            f = self.failure
            e = RefitNotCommitted(f"reshard backend: not published: {self.failed}")
            e.written, e.partial, e.untouched = f["written"], f["partial"], f["untouched"]
            raise e
        if self.pending is None:
            raise Error("reshard backend: finish_weight_update without a received update")
        if self.staging is not None:  # the committed version into the live parameters
            t0 = time.monotonic()
            with torch.no_grad():
                for n, t in self.live.buffers.items():
                    t.copy_(self.staging[n])
            self.last_report["swap_seconds"] = time.monotonic() - t0
        t0 = time.monotonic()
        self.live.refresh()  # what vLLM derives from the new weights (MLA's W_UK_T / W_UV of FP8 models)
        self.last_report["refresh_seconds"] = time.monotonic() - t0
        self.version, self.pending, self.started = self.pending, None, False
        self.failure, self.repaired = None, False  # a repair's update committed: every element written

    def shutdown(self) -> None:
        r, self.resharder = self.resharder, None
        if self.failure is not None and not self.repaired:
            drop_resharder(r)  # its peers may be gone: no collective close
        elif r is not None:
            r.close()
        self.close_endpoint()


def failure_report(e: Error, version: Optional[int], published: Optional[int], params: List[str], *,
                   transactional: bool = False) -> dict:
    """What a failed update left in this rank's parameters, from the refit's error (CONTRACT.md §5)."""
    if transactional:  # the refit wrote a staging copy: the live parameters hold the published version
        written, partial, untouched = [], [], list(params)
    elif all(hasattr(e, k) for k in ("written", "partial", "untouched")):
        written, partial, untouched = list(e.written), list(e.partial), list(e.untouched)
    else:  # an error that does not say: any parameter may have been written
        written, partial, untouched = [], list(params), []
    before = f"version {published}" if published is not None else "the weights before the first update"
    text = (f"the update to version {version} failed: {e}. This rank's {len(params)} parameters: "
            f"{len(written)} hold version {version} entirely, {len(partial)} were written in part (a mix of "
            f"version {version} and {before}), {len(untouched)} hold {before}"
            + (" (transactional: the update went to a staging copy)" if transactional else "")
            + ". Repair: set up again (ReshardTrainerEngine.repair(), or a restarted trainer's trainer_init), then "
            "an update that commits rewrites every parameter")
    return {"version": version, "published": published, "error": str(e), "written": written, "partial": partial,
            "untouched": untouched, "text": text}
