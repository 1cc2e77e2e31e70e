"""Refits: every rank as a thread of this process (:func:`refit_local`), or one process's endpoint of a
multi-process refit over UCX (:class:`Resharder`)."""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any, Mapping, Optional

from . import _core
from ._core import Layout
from .buffers import RankBuffers, _prepare
from .errors import Error, TransportError
from .features import has_ucx
from .planning import Schedule
from .store import _generations, _generations_lock, _is_torch_store, _ranks_on_store, _serves_store, _StoreAdapter
from .stream_order import _caller_order, _cuda_devices


def refit_local(src: Layout, dst: Layout, buffers: Mapping[int, RankBuffers], *, iterations: int = 1,
                timeout: float = 300.0, staging_budget: Optional[int] = None, cast: bool = False,
                stream: Any = None) -> dict:
    """Refits ``src`` -> ``dst`` with every rank of both sides as a thread of this process.

    ``buffers`` maps each global rank to its buffers ``{name: tensor}``
    (``{"src": {...}, "dst": {...}}`` where a rank has a buffer of one name on
    both sides). Source tensors are read, destination tensors written in
    place. The GIL is released while the threads run. ``cast`` as for
    :class:`Resharder`.

    CUDA tensors (where :data:`has_cuda`; ranks as threads sharing the
    process's GPUs, bytes moved by ``cudaMemcpy``): each rank's tensors on one
    GPU, a copy engine for each such rank. The refit starts after the work
    enqueued so far on ``stream`` (default: the current stream of the
    tensors' GPU; tensors on several GPUs: each device is synchronized
    first) and returns after every copy is done.

    Returns a report: ``bytes_moved`` (bytes between different ranks, per
    refit), ``seconds`` (median over ``iterations``, first start to last
    finish), ``local_bytes``, ``messages``, ``plan_seconds``,
    ``iteration_seconds`` and more.
    """
    if not isinstance(buffers, Mapping):
        raise Error("refit_local: buffers must map each global rank to {buffer name: tensor}")
    prepared = {r: _prepare(b) for r, b in buffers.items()}
    devices = _cuda_devices(prepared)
    order = _core.CallerOrder()
    if len(devices) == 1:
        order = _caller_order(next(iter(devices)), stream, None, None, False)
    elif devices:
        if stream is not None:
            raise Error(f"refit_local: tensors on {len(devices)} GPUs ({sorted(devices)}); a stream orders one GPU's work")
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            for d in devices:
                torch.cuda.synchronize(d)
    elif stream is not None:
        raise Error("refit_local: a stream orders CUDA tensors; these are host memory")
    return _core.refit_local(src, dst, prepared, iterations, float(timeout), staging_budget, bool(cast), order)


class Resharder:
    """One process's endpoint of a multi-process refit (UCX), bootstrapped through a key-value store.

    Every global rank of both layouts creates one, with the same layouts, the
    same store and the same ``prefix``, in the same order as its other
    Resharders on that store (rank R's k-th Resharder on a store object and
    prefix meets the k-th of every other rank: keys ``{prefix}/{k}/...``;
    counted per store object, prefix and rank, so rank threads of one
    process may share one store client). Construction is collective:
    it connects the ranks, plans this rank's part and checks its buffers
    (a bad buffer on any rank makes every rank's constructor raise).

    ``buffers`` are this rank's tensors ``{name: tensor}`` (source buffers
    are read, destination buffers written in place; ``{"src": {...},
    "dst": {...}}`` where a rank has a buffer of one name on both sides).
    They stay bound: change the source tensors' values in place between
    refits, do not replace them.

    ``store``: ``torch.distributed.TCPStore`` or any object with
    ``set(key, bytes)`` and ``get(key) -> bytes`` (with ``check(keys)`` or a
    ``get`` that raises ``KeyError`` on a missing key, the waits keep their
    deadlines). A rank that never arrives or dies makes every other rank
    raise :class:`TransportError` naming it within ``stall_timeout`` plus
    its quarter and a second (about 13.5 s by default), never a hang; a
    refit that did not complete on every rank raises
    :class:`RefitNotCommitted` and never returns a report.

    ``timeout`` bounds one refit (seconds); ``stall_timeout`` is how long a
    wait tolerates no progress; ``protocol`` is ``"tag"`` or ``"put"``;
    ``ucx_config`` sets UCX options over the environment's, e.g.
    ``{"TLS": "tcp,self"}``; ``fast_data_endpoint`` moves data on a second
    endpoint per peer without peer-failure handling, which lets UCX 1.13 use
    CMA zero-copy between processes of one host (about 2-3x faster there) but
    makes a peer that dies mid-copy abort this process instead of raising:
    leave it off unless that trade is wanted (UcxOptions::fast_data_endpoint).

    ``double_buffered=True`` (every rank alike; ranks with destination
    buffers also give ``back_buffers``, a second set of the same names and
    shapes): each refit writes the set not being served and publishes it only
    once the new version is complete on every rank; ``serving_set`` says
    which set inference should read (0: ``buffers``, 1: ``back_buffers``). A
    failed refit leaves the served set untouched.

    ``delta=True`` (every rank alike; host memory): after
    the first refit, each refit sends only the elements whose bits changed
    since what the receiver holds, and leaves every destination bit-identical
    to a dense refit (docs/delta.md). Each sender keeps a shadow of what it
    sent (its sent bytes; ``shadow_budget`` bounds it per destination set,
    pairs past it refit dense). Above ``dense_above`` of the elements changed
    (default 0.06) the refit goes dense. The report's ``delta`` says what
    happened (``mode``: ``prime``, ``delta``, ``dense``, ``sampled`` or
    ``streak``; ``changed_fraction`` over all ranks; ``payload_bytes`` this
    rank sent). The destination must hold what the last refit wrote: a rank
    whose destination something else wrote (inference processing weights
    in place) calls :meth:`invalidate_delta_base` before the next refit.

    ``cast=True`` (every rank alike): a tensor whose float dtype differs
    between the sides (f32, bf16, f16: an f32 master copy or an unwrapped
    model's f32 norms into a bf16 engine) is converted in flight, rounding to
    nearest even as ``Tensor.to()`` does; the sender converts what it sends
    (into a shadow of the destination's dtype, host memory), so the
    destination's dtype crosses the wire. With ``delta=True`` the delta is
    taken on those cast values: an f32 master refit into bf16 sends only the
    elements whose bf16 value changed, and the delta shadow holds what the
    receiver holds (the destination's dtype: half the master's bytes for
    bf16), bit-exact with a dense cast refit (docs/delta.md, "Casts").
    Also with ``double_buffered``. Without ``cast=True`` such a tensor is
    an error naming it.
    """

    def __init__(self, src: Layout, dst: Layout, rank: int, buffers: RankBuffers, transport: str = "ucx",
                 store: Any = None, *, prefix: str = "reshard", timeout: float = 300.0, stall_timeout: float = 10.0,
                 protocol: str = "tag", ucx_config: Optional[Mapping[str, str]] = None,
                 staging_budget: Optional[int] = None, fast_data_endpoint: bool = False,
                 double_buffered: bool = False, back_buffers: Optional[Mapping[str, Any]] = None,
                 delta: bool = False, shadow_budget: Optional[int] = None, dense_above: Optional[float] = None,
                 cast: bool = False) -> None:
        if transport != "ucx":
            raise Error(f"Resharder: transport '{transport}' is not available from Python (use 'ucx'; "
                        "refit_local runs every rank in one process)")
        if not has_ucx:
            raise Error("Resharder: this build of reshard has no UCX transport (install libucx-dev and reinstall)")
        if store is None:
            raise Error("Resharder: a store is needed for the rendezvous (torch.distributed.TCPStore or an object "
                        "with set(key, bytes) and get(key) -> bytes)")
        adapter = _StoreAdapter(store)
        # Counted per (store object, prefix, rank): rank threads of one process may share a store client.
        with _generations_lock:
            key = (id(store), prefix, int(rank))
            g = _generations.get(key, 0)
            _generations[key] = g + 1
            _ranks_on_store.setdefault(id(store), set()).add(int(rank))
        self._store = store
        self._prefix = f"{prefix}/{g}"
        self._stall = float(stall_timeout)
        self._closed = False
        self._r = _core.UcxResharder(src, dst, int(rank), _prepare(buffers), adapter, self._prefix, float(timeout),
                                     float(stall_timeout), protocol, sorted((ucx_config or {}).items()), staging_budget,
                                     bool(fast_data_endpoint), bool(double_buffered),
                                     None if back_buffers is None else _prepare(back_buffers), bool(delta), shadow_budget,
                                     None if dense_above is None else float(dense_above), bool(cast))

    def refit(self, version: Optional[int] = None, *, stream: Any = None, sources_final: Any = None,
              destination_free: Any = None, wait: bool = False) -> dict:
        """Moves the weights (collective: every rank calls it). Returns this rank's report.

        The report holds ``bytes_moved`` (bytes this rank sent), ``seconds``,
        ``version`` (the committed version), ``messages``,
        ``bytes_received``, ``local_bytes``, ``device`` and the plan's
        figures. The GIL is released while data moves.

        CUDA tensors are ordered with ``stream`` (default: the current torch
        stream of their GPU): the refit reads the sources after the work
        enqueued on it so far, or after the event ``sources_final`` (a
        ``torch.cuda.Event`` the trainer recorded after its optimizer step),
        writes the destination after that work, or after
        ``destination_free``, and the stream waits for the refit's last copy,
        so kernels enqueued on it next read the new weights, without the host
        waiting for the copies. ``wait=True``: the host waits too.
        """
        order = _caller_order(self._r.device, stream, sources_final, destination_free, wait)
        return self._r.refit(version, order)

    def close(self) -> None:
        """Waits until every rank closed (collective), then frees the transport. Idempotent.

        With a store that has ``add`` (TCPStore), each rank counts itself in
        and waits until every rank has, then counts itself out; the process
        hosting the store also waits until every rank counted itself out, so
        it can exit as soon as its own ``close()`` returns: no rank still needs it.
        """
        if self._closed:
            return
        self._closed = True
        self._r.close(True)
        add = getattr(self._store, "add", None)
        if add is None:
            return
        key = f"{self._prefix}/closed"
        world = len(self._r.world)
        bound = self._stall * 1.25 + 1
        deadline = time.monotonic() + bound
        n = int(add(key, 1))
        # One rank per store client: wait blocks the client, so ranks sharing one poll instead.
        with _generations_lock:
            alone = len(_ranks_on_store.get(id(self._store), ())) == 1
        wait = self._store.wait if alone and _is_torch_store(self._store) else None
        if wait is not None:
            # The last rank in says so under one key that the others wait for (TCPStore.wait: one
            # request each, answered when it is set) rather than every rank polling the count.
            done = f"{self._prefix}/all_closed"
            if n >= world:
                self._store.set(done, b"1")
            try:
                wait([done], datetime.timedelta(seconds=bound))
            except Exception:
                if time.monotonic() < deadline:
                    return  # the store's host left: it does so only once every rank counted itself out
                try:
                    n = int(add(key, 0))
                except Exception:
                    return  # the store's host left
                raise TransportError(f"rank {self.rank}: close: only {n} of {world} ranks closed within "
                                     f"{bound:.1f} s (a rank died or did not call close())") from None
        else:
            while True:
                try:
                    n = int(add(key, 0))
                except Exception:
                    return  # the store's host left: it does so only once every rank counted itself out
                if n >= world:
                    break
                if time.monotonic() > deadline:
                    raise TransportError(f"rank {self.rank}: close: only {n} of {world} ranks closed within "
                                         f"{bound:.1f} s (a rank died or did not call close())")
                time.sleep(0.005)
        self._leave(add, world, deadline)

    def _leave(self, add: Any, world: int, deadline: float) -> None:
        """Every rank closed. Each counts itself out with one last request; the process hosting the store
        then waits until every rank has, so that it exits only after each client's last request was
        answered (one in flight when the host exits makes c10d print a 'recvValue failed' trace)."""
        key = f"{self._prefix}/left"
        try:
            n = int(add(key, 1))
        except Exception:
            return  # the store's host left early (its own deadline passed)
        if n >= world or not _serves_store(self._store):
            return
        while time.monotonic() < deadline + 1:
            time.sleep(0.002)
            try:
                if int(add(key, 0)) >= world:
                    return
            except Exception:
                return  # this process's own store server is gone: nobody can still be waiting on it
        # Every rank closed, so the refit is complete; a client that did not count itself out
        # died after its close() or is slow to: at worst its process prints c10d's warning.

    def invalidate_delta_base(self) -> None:
        """With ``delta=True``: this rank's destination was written by something else, so the next refit
        of every rank is dense. This rank alone calls it, between refits: the request travels with the
        next refit."""
        self._r.invalidate_delta_base()

    def schedule(self) -> Schedule:
        """This rank's part of the plan."""
        return Schedule(self._r.schedule())

    @property
    def rank(self) -> int:
        return self._r.rank

    @property
    def world(self) -> "list[int]":
        """Every global rank of both layouts (the processes of this refit)."""
        return self._r.world

    @property
    def state(self) -> str:
        """``empty`` (no refit committed), ``current``, ``stale`` (a failed refit wrote part of the destination) or ``closed``."""
        return self._r.state

    @property
    def serving_set(self) -> int:
        """Double-buffered: the destination set to serve (0: ``buffers``, 1: ``back_buffers``); else 0."""
        return self._r.serving_set

    @property
    def last_good_version(self) -> int:
        return self._r.last_good_version

    def __enter__(self) -> "Resharder":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()

    def __repr__(self) -> str:
        return (f"<reshard.Resharder rank {self.rank} of {len(self.world)}: {self._r.src.origin} -> {self._r.dst.origin}, "
                f"state {self.state}, version {self.last_good_version}>")
