"""The backend's coordination on the store both sides share: the setup settings both sides carry, setup
errors published for every rank, the engines' heartbeats while they set up, each update's bytes, and
one control-plane call run beside a collective."""
from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import Error, Resharder

log = logging.getLogger("reshard")

#: Seconds between an engine rank's heartbeats on the store while it sets up.
BEAT_SECONDS = 1.0


@dataclass(kw_only=True)
class TransferSettings:
    """The settings both sides' init infos carry (the trainer passes its own to the engines): the store
    prefix, the transport, refit time limits in seconds (``timeout`` bounds a refit and the wait for the
    first heartbeat of the engines' setup, ``stall_timeout`` a wait without progress, a setup's included),
    delta refits and transactional engines."""
    prefix: str = "reshard-vllm"
    transport: str = "ucx"
    timeout: float = 300.0
    stall_timeout: float = 10.0
    delta: bool = False
    transactional: bool = False

    def settings(self) -> Dict[str, Any]:
        """These settings by name, as the engines' init info takes them."""
        return {f.name: getattr(self, f.name) for f in fields(TransferSettings)}


class SetupStore:
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


class Heartbeat:
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


def await_engines(store: Any, prefix: str, *, first_beat: float, silence: float, rpc: "Optional[Background]" = None,
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


def log_phase(what: str, t0: float) -> float:
    now = time.monotonic()
    log.info("reshard: %s: %.2f s", what, now - t0)
    return now


def drop_resharder(resharder: Optional[Resharder]) -> None:
    """Frees a Resharder without the collective close (after a failure its peers may be gone)."""
    if resharder is not None and not resharder._closed:
        resharder._closed = True
        resharder._r.close(False)


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


class Background:
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
