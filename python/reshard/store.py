"""The store bootstrap: the key-value store the ranks of a :class:`reshard.Resharder` meet through."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence

from .errors import Error


class _StoreAdapter:
    """What the C++ bootstrap calls: set, poll (non-blocking get) and delete over the caller's store."""

    def __init__(self, store: Any) -> None:
        if not (hasattr(store, "set") and hasattr(store, "get")):
            raise Error(f"Resharder: the store must have set(key, bytes) and get(key) -> bytes; got a {type(store).__name__}")
        self.store = store
        self._check = getattr(store, "check", None)
        self._delete = getattr(store, "delete_key", None)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def poll(self, keys: Sequence[str]) -> "list[Optional[bytes]]":
        keys = list(keys)
        if self._check is not None and self._check(keys):
            # All there: one request for all (TCPStore's multi_get) instead of one per rank.
            multi_get = getattr(self.store, "multi_get", None)
            values = multi_get(keys) if multi_get is not None else [self.store.get(k) for k in keys]
            return [v.encode("latin-1") if isinstance(v, str) else bytes(v) for v in values]
        out: "list[Optional[bytes]]" = []
        for k in keys:
            if self._check is not None:
                v = self.store.get(k) if self._check([k]) else None
            else:
                # A store without check(): get() must raise KeyError (or
                # LookupError) for a missing key; one that blocks instead
                # bounds the wait by its own timeout only.
                try:
                    v = self.store.get(k)
                except LookupError:
                    v = None
            if isinstance(v, str):
                v = v.encode("latin-1")
            out.append(None if v is None else bytes(v))
        return out

    def delete(self, key: str) -> None:
        if self._delete is not None:
            try:
                self._delete(key)
            except Exception:
                pass


def _is_torch_store(store: Any) -> bool:
    """A torch.distributed store (TCPStore, FileStore, PrefixStore ...): it has wait(keys, timedelta)."""
    return any(c.__name__ == "Store" and c.__module__.startswith("torch") for c in type(store).__mro__)


def _listening_socket_inodes(port: int) -> "set[str]":
    """The inodes of the TCP sockets listening on ``port`` on this host (/proc/net/tcp, tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the inode.
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except (OSError, ValueError, StopIteration):
            continue
    return inodes


def _serves_store(store: Any) -> bool:
    """Whether this process hosts the TCPStore that ``store`` talks to (its listening socket is one of this
    process's descriptors). False where that cannot be told (no port, no /proc): then close() cannot keep
    the host until its clients are done, which costs at most c10d's warning in their processes."""
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    port = getattr(store, "port", None)
    if not isinstance(port, int) or port <= 0:
        return False
    inodes = _listening_socket_inodes(port)
    if not inodes:
        return False
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


_generations: "dict[tuple[int, str, int], int]" = {}
_ranks_on_store: "dict[int, set[int]]" = {}  # the ranks of this process that made a Resharder on each store object
_generations_lock = threading.Lock()
