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
  committed on every rank (reshard's versioned commit). ``start_weight_update``
  while an update is unfinished is refused, naming ``finish_weight_update``.

After a failed update each surviving engine rank holds what its
:attr:`ReshardWeightTransferEngine.failure` says, parameter by parameter:
``written`` (the failed version entirely), ``partial`` (a mix of it and the
last published version) and ``untouched`` (the last published version);
``finish_weight_update`` raises :class:`reshard.RefitNotCommitted` carrying
the same, and the engine refuses to publish or start another update until it
is repaired: set up again (``init_transfer_engine``, which the trainer's
:meth:`ReshardTrainerEngine.repair` or a restarted trainer's ``trainer_init``
sends), then one update that commits, which is dense (every element written).

Setup fails at once everywhere: a rank that fails publishes its error on the
store, and every trainer and engine rank raises it; engines beat on the store
while they set up, so the trainer waits as long as setup takes and names a
rank that went silent. Each phase logs a line with its seconds on the
``reshard`` logger.

Rendezvous: a ``torch.distributed.TCPStore`` that trainer rank 0 hosts
(``store_host`` / ``store_port``; port 0 picks a free one, with one trainer
rank only). Transport: UCX.
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
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, Replicate, Shard, TrainerInitInfo,
                                                   TrainerWeightTransferEngine, WeightTransferEngine,
                                                   WeightTransferInitInfo, WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from . import Error, Layout, RefitNotCommitted, Resharder, layout_from_json
from .engines.dtensor import placement_layout
from .engines.rows import split_rows
from .engines.vllm import live_layout, reshard_dtype

BACKEND = "reshard"
log = logging.getLogger("reshard")

#: Seconds between an engine rank's heartbeats on the store while it sets up.
BEAT_SECONDS = 1.0


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
        out = type(e)(f"{e} [{legend}]")
    except TypeError:
        return Error(f"{e} [{legend}]")
    for k in ("written", "partial", "untouched"):  # RefitNotCommitted's report of this rank's memory
        if hasattr(e, k):
            setattr(out, k, getattr(e, k))
    return out


# --- setup: checkpoint against model, errors and heartbeats on the store ------------------------------


def config_differences(checkpoint: Sequence[Tuple[str, Sequence[int]]], hf_config: Any) -> List[str]:
    """Where the trainer's checkpoint (names and shapes) and the engine's model config disagree: layers,
    vocabulary, experts. Empty when they agree as far as these tell."""
    names = [n for n, _ in checkpoint]
    out = []
    layers = {int(m.group(1)) for n in names if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", n))}
    want = getattr(hf_config, "num_hidden_layers", None)
    extra = getattr(hf_config, "num_nextn_predict_layers", 0) or 0  # MTP layers follow the decoder's
    if layers and want is not None and not want <= max(layers) + 1 <= want + extra:
        out.append(f"layers: the trainer's checkpoint has {max(layers) + 1}, the engine's model {want}")
    vocab = getattr(hf_config, "vocab_size", None)
    for n, shape in checkpoint:
        if n.endswith("embed_tokens.weight") and vocab is not None and shape and shape[0] != vocab:
            out.append(f"vocabulary: the trainer's {n} has {shape[0]} rows, the engine's model {vocab}")
    experts = {int(m.group(1)) for n in names if (m := re.search(r"\.experts\.(\d+)\.", n))}
    fused = [shape[0] for n, shape in checkpoint if re.search(r"\.experts\.(gate_up_proj|down_proj)$", n) and shape]
    have = len(experts) if experts else (fused[0] if fused else None)
    want_e = next((getattr(hf_config, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                   if getattr(hf_config, k, None)), None)
    if have is not None and want_e is not None and have != want_e:
        out.append(f"experts: the trainer's checkpoint has {have}, the engine's model {want_e}")
    return out


def _module_prefix(param: str) -> str:
    """The checkpoint prefix a vLLM parameter's tensors live under: its decoder layer, or its module."""
    m = re.match(r"(.*?(?:^|\.)layers\.\d+)\.", param)
    return m.group(1) if m else param.rsplit(".", 1)[0]


def untraced_error(untraced: Sequence[str], checkpoint_names: Sequence[str], differences: Sequence[str]) -> str:
    """Why this engine's parameters cannot all be refit: the trainer and engine configs differ (as far as
    ``config_differences`` tells), parameters absent from the trainer's checkpoint, or parameters vLLM's
    loader computes rather than copies."""
    absent = [p for p in untraced if not any(n.startswith(_module_prefix(p) + ".") for n in checkpoint_names)]
    computed = [p for p in untraced if p not in absent]
    parts = []
    if differences:
        parts.append(f"the trainer's checkpoint does not fit this engine's model, their configs differ: "
                     f"{'; '.join(differences)}")
    if absent:
        parts.append("the trainer's checkpoint lacks these parameters (trainer and engine configs differ: layers, "
                     f"vocabulary, experts?): {', '.join(sorted(absent))}")
    if computed:
        parts.append("vLLM's loader computes these parameters rather than copying them, so this backend cannot "
                     f"refit them in place yet: {', '.join(sorted(computed))}")
    return "reshard backend: " + "; ".join(parts)


class _SetupStore:
    """The backend's store as a Resharder's bootstrap polls it: each poll also looks for a setup error that
    a rank published under ``error_key`` and raises it, so every rank fails at once with that rank's words
    instead of waiting for its store timeout."""

    def __init__(self, store: Any, error_key: str) -> None:
        self.underlying_store = store
        self.error_key = error_key

    def __getattr__(self, name: str) -> Any:
        return getattr(self.underlying_store, name)

    def check(self, keys: List[str]) -> bool:
        raise_published(self.underlying_store, self.error_key)
        return self.underlying_store.check(keys)


def raise_published(store: Any, error_key: str) -> None:
    if store.check([error_key]):
        raise Error(store.get(error_key).decode())


def publish_error(store: Any, error_key: str, text: str) -> None:
    """The first error of a setup round, for every other rank to raise (later ones keep the first)."""
    try:
        if not store.check([error_key]):
            store.set(error_key, text.encode())
    except Exception as e:  # the store itself is gone: the peers see that instead
        log.warning("reshard: could not publish the setup error (%s): %s", e, text)


class _Heartbeat:
    """An engine rank's beats on the store while it sets up (its own store client: a TCPStore client is
    one thread's)."""

    def __init__(self, host: str, port: int, key: str, timeout: float) -> None:
        self.stop_event = threading.Event()
        self.store = torch.distributed.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout))
        self.key = key
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.store.add(self.key, 1)
            except Exception:
                return  # the store's host left: the setup fails by itself
            self.stop_event.wait(BEAT_SECONDS)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join()


def await_engines(store: Any, prefix: str, *, first_beat: float, silence: float, rpc: "Optional[_Background]" = None,
                  rank: int = 0) -> str:
    """The engines' layout, once their rank 0 published it. Waits as long as the engines keep beating;
    raises at once with a rank's published setup error, or when the RPC that starts them failed, or names
    the vLLM ranks that went silent for ``silence`` s (or never beat within ``first_beat`` s)."""
    t0 = time.monotonic()
    seen: Dict[int, Tuple[int, float]] = {}
    while True:
        raise_published(store, f"{prefix}/setup_error")
        if store.check([f"{prefix}/dst_layout"]):
            return store.get(f"{prefix}/dst_layout").decode()
        if rpc is not None and not rpc.thread.is_alive() and rpc.error is not None:
            raise Error(f"reshard trainer rank {rank}: init_weight_transfer_engine failed: {rpc.error}")
        now = time.monotonic()
        n = int(store.get(f"{prefix}/engines")) if store.check([f"{prefix}/engines"]) else 0
        for r in range(n):
            beats = int(store.add(f"{prefix}/beat/{r}", 0))
            if r not in seen or seen[r][0] != beats:  # silence counts from a rank's last beat, or its first sight
                seen[r] = (beats, now)
        silent = [r for r in range(n) if now - seen[r][1] > silence]
        if silent or (n == 0 and now - t0 > first_beat):
            who = (f"vLLM rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped beating for over "
                   f"{silence:.0f} s (dead, or stuck without progress)" if silent else
                   f"no vLLM rank started setting up within {first_beat:.0f} s (init_weight_transfer_engine not "
                   "delivered, or the engines are dead)")
            raise Error(f"reshard trainer rank {rank}: waiting for the engines' setup: {who}")
        time.sleep(0.05)


def _phase(what: str, t0: float) -> float:
    now = time.monotonic()
    log.info("reshard: %s: %.2f s", what, now - t0)
    return now


def _drop(resharder: Optional[Resharder]) -> None:
    """Frees a Resharder without the collective close (after a failure its peers may be gone)."""
    if resharder is not None and not resharder._closed:
        resharder._closed = True
        resharder._r.close(False)


# --- trainer side ---------------------------------------------------------------


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: ``rank`` (keyword) and the trainer's ``world_size``; where trainer rank 0
    hosts the store (a fixed ``store_port`` with several trainer ranks); the transport; refit time limits
    (seconds: ``timeout`` bounds a refit and the wait for the first heartbeat of the engines' setup,
    ``stall_timeout`` a wait without progress, a setup's included)."""
    backend: ClassVar[str] = BACKEND
    world_size: int = 1
    store_host: str = "127.0.0.1"
    store_port: int = 0
    prefix: str = "reshard-vllm"
    transport: str = "ucx"
    timeout: float = 300.0
    stall_timeout: float = 10.0
    delta: bool = False
    transactional: bool = False


class ReshardTrainerEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """Every trainer rank holds one; ``send_weights()`` refits the rollout engine from this rank's pieces."""
    init_info_cls = ReshardTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: Any, source: Any = None) -> "ReshardTrainerEngine":
        if source is None:
            raise Error("reshard trainer: give source= (a WeightSource: e.g. vLLM's ModuleSource(model))")
        info = init_info
        if info.store_port == 0 and info.world_size > 1:
            raise Error("reshard trainer: with several trainer ranks give a fixed store_port (port 0 picks one "
                        "only rank 0 would know)")
        self = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        self.info, self.version, self.round, self.resharder, self.last_report = info, 0, 0, None, None
        self.attempts = 0  # start_weight_update calls, refused ones included (each its own store key)
        self.failed = False  # an update failed since the last setup
        timeout = datetime.timedelta(seconds=info.timeout)
        if self.is_sender:
            self.store = torch.distributed.TCPStore(info.store_host, info.store_port, None, True, timeout=timeout,
                                                    wait_for_workers=False)
        else:
            self.store = torch.distributed.TCPStore(info.store_host, info.store_port, None, False, timeout=timeout)
        t0 = time.monotonic()
        try:
            self.src = layout_from_param_meta(source.metadata, info.world_size)
            mine = {b["name"] for b in self.src.buffers(info.rank)}  # once: a lookup per parameter stays O(1)
            self.buffers = {n: (t.detach() if getattr(t, "requires_grad", False) else t)
                            for n, t in source.iter_local() if n in mine}
        except BaseException as e:
            publish_error(self.store, f"{self.prefix}/setup_error", f"trainer rank {info.rank}: {e}")
            raise
        _phase(f"trainer rank {info.rank}: layout of {len(self.src.tensors)} parameters from the source", t0)
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
        worker_info = {"store_host": info.store_host, "store_port": self.store.port, "trainer_world": info.world_size,
                       "src_layout": self.src.to_json(), "prefix": self.prefix, "transport": info.transport,
                       "timeout": info.timeout, "stall_timeout": info.stall_timeout, "delta": info.delta,
                       "transactional": info.transactional}
        rpc = _Background(lambda: self.client.init_weight_transfer_engine(worker_info)) if self.is_sender else None
        try:
            dst = layout_from_json(await_engines(self.store, self.prefix, first_beat=info.timeout,
                                                 silence=info.stall_timeout, rpc=rpc, rank=info.rank),
                                   "the vLLM engine's traced layout")
            t0 = _phase(f"trainer rank {info.rank}: the engines traced their layout", t0)
            self.legend = rank_legend(info.world_size, len(dst.ranks))
            # Rows of fused checkpoint tensors that the engine holds apart: ranges of their own on both sides.
            self.resharder = Resharder(split_rows(self.src, dst), dst, rank=info.rank, buffers=self.buffers,
                                       transport=info.transport,
                                       store=_SetupStore(self.store, error_key), prefix=self.prefix,
                                       timeout=info.timeout, stall_timeout=info.stall_timeout, delta=info.delta,
                                       cast=True)
            _phase(f"trainer rank {info.rank}: plan, transport and memory set up", t0)
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
        _drop(self.resharder)
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
        self._agree_to_start(self.version + 1)
        self.version += 1
        rpc = _Background(lambda: self.client.update_weights({"version": self.version})) if self.is_sender else None
        failed: Optional[Error] = None
        try:
            rep = self.resharder.refit()
        except Error as e:
            failed = e
        # The engines' answers are joined either way; the refit's error is the one that names the rank.
        engines = rpc.join_error() if rpc else None
        if failed is not None:
            self.failed = True
            raise _with_legend(failed, self.legend + (f"; the vLLM engines said: {engines}" if engines else "")) \
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
            _drop(r)  # its peers may be gone: no collective close
        elif r is not None:
            r.close()


def update_report(rep: dict, version: int) -> dict:
    """An update's report on one rank, from its refit's."""
    return {"version": version, "seconds": rep["seconds"], "mode": rep.get("delta", {}).get("mode", "dense"),
            "bytes_sent": rep["bytes_sent"], "bytes_received": rep["bytes_received"], "refit": rep}


def publish_bytes(store: Any, prefix: str, version: int, rep: dict) -> None:
    store.set(f"{prefix}/bytes/{version}/{rep['rank']}", json.dumps([rep["bytes_sent"], rep["bytes_received"]]))


def gather_bytes(store: Any, prefix: str, version: int, world: int, timeout: float) -> dict:
    """Every rank's bytes of an update (each publishes its own once its refit committed)."""
    keys = [f"{prefix}/bytes/{version}/{r}" for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=timeout))
    per = {r: json.loads(v) for r, v in enumerate(store.multi_get(keys))}
    for k in keys:
        store.delete_key(k)
    return {"rank_bytes": {r: {"sent": s, "received": x} for r, (s, x) in per.items()},
            "bytes": sum(s for s, _ in per.values())}


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
    transactional: bool = False


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    version: Optional[int] = None


def _vllm_rank() -> Tuple[int, int]:
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

    @property
    def failed(self) -> Optional[str]:
        """Why the engine refuses updates (None when it does not)."""
        return None if self.failure is None else self.failure["text"]

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        """Sets the transfer up (again, after a failure: a repair). Any error is published on the store
        for every other rank before it is raised here."""
        info = init_info
        vrank, vworld = _vllm_rank()
        store = torch.distributed.TCPStore(info.store_host, info.store_port, None, False,
                                           timeout=datetime.timedelta(seconds=info.timeout))
        error_key = f"{info.prefix}/setup_error"
        _drop(self.resharder)
        self.resharder = None
        store.set(f"{info.prefix}/engines", str(vworld))
        beat = _Heartbeat(info.store_host, info.store_port, f"{info.prefix}/beat/{vrank}", info.timeout)
        try:
            self._set_up(info, store, error_key)
        except BaseException as e:
            publish_error(store, error_key, f"vLLM rank {vrank}: {e}")
            raise
        finally:
            beat.stop()
        self.started, self.pending = False, None
        self.repaired = self.failure is not None

    def _set_up(self, info: ReshardInitInfo, store: Any, error_key: str) -> None:
        if str(self.device) != "cpu":
            raise Error(f"reshard backend: device {self.device}: this build moves host memory only")
        t0 = time.monotonic()
        raise_published(store, error_key)  # a trainer rank that failed first
        src = layout_from_json(info.src_layout, "the trainer's layout")
        ckpt = [(t["name"], t["shape"]) for t in json.loads(info.src_layout)["tensors"]]
        differences = config_differences(ckpt, self.model_config.hf_config)
        if differences:
            raise Error(untraced_error([], [n for n, _ in ckpt], differences))
        dtypes = [(t["name"], t["shape"], t["dtype"]) for t in json.loads(info.src_layout)["tensors"]]
        live = live_layout(self.model, dtypes, first_rank=info.trainer_world)
        if live.untraced:
            raise Error(untraced_error(list(live.untraced), [n for n, _ in ckpt], []))
        t0 = _phase(f"vLLM rank {live.rank - info.trainer_world}: layout traced through vLLM's loader", t0)
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
                                   store=_SetupStore(store, error_key), prefix=info.prefix, timeout=info.timeout,
                                   stall_timeout=info.stall_timeout, delta=info.delta, cast=True)
        self.store, self.prefix = store, info.prefix
        _phase(f"vLLM rank {live.rank - info.trainer_world}: plan, transport and memory set up", t0)

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
        self.started = True

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
            raise _with_legend(e, self.legend) from e
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
        self.version, self.pending, self.started = self.pending, None, False
        self.failure, self.repaired = None, False  # a repair's update committed: every element written

    def shutdown(self) -> None:
        r, self.resharder = self.resharder, None
        if self.failure is not None and not self.repaired:
            _drop(r)  # its peers may be gone: no collective close
        elif r is not None:
            r.close()


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


def register() -> None:
    """Registers the backend in both factories (idempotent): importing this module does it, and so does
    vLLM's plugin loader in each process it starts (the package's ``vllm.general_plugins`` entry point)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ReshardWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, ReshardTrainerEngine)


register()
