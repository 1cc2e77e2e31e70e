"""Plans: which rank sends which strided piece to which rank."""

from __future__ import annotations

import json
from typing import Optional

from . import _core
from ._core import Layout


class Schedule:
    """A planned refit: every copy (ranks, buffers, offsets, extents, strides on both sides).

    ``stats`` is the dict ``reshard-plan --stats`` prints (``bytes``,
    ``local_bytes``, ``copies``, ``max_send_bytes``, ``max_recv_bytes``,
    ``ranks``, ``plan_seconds``); ``to_json()`` is ``reshard-plan --json``.
    """

    __slots__ = ("_s", "_stats")

    def __init__(self, core: "_core.Schedule") -> None:
        self._s = core
        self._stats: Optional[dict] = None

    @property
    def stats(self) -> dict:
        """The schedule's figures, with exactly the keys of ``reshard-plan --stats``."""
        if self._stats is None:
            self._stats = json.loads(self._s.stats_json)
        return dict(self._stats)

    def to_json(self) -> str:
        """The schedule in the contract's format (``reshard.schedule/1``, CONTRACT.md section 2)."""
        return self._s.to_json()

    @property
    def copies(self) -> int:
        """How many copies the schedule holds."""
        return self._s.copies

    @property
    def only_rank(self) -> Optional[int]:
        """The rank this schedule was planned for, or None for a full plan."""
        return self._s.only_rank

    def __len__(self) -> int:
        return self._s.copies

    def __repr__(self) -> str:
        st = self.stats
        who = "" if self.only_rank is None else f" for rank {self.only_rank}"
        return (f"<reshard.Schedule{who} {self._s.src_origin} -> {self._s.dst_origin}: {st['copies']} copies, "
                f"{st['bytes']} B over the network, {st['local_bytes']} B local, {st['ranks']} ranks>")


def plan(src: Layout, dst: Layout, rank: Optional[int] = None, *, cast: bool = False) -> Schedule:
    """Plans the refit from ``src`` to ``dst``; ``rank`` plans only what that global rank sends and receives.
    ``cast=True``: a tensor whose float dtype differs between the sides (f32, bf16, f16) is converted in
    flight (see :class:`Resharder`); else that is an error naming it."""
    return Schedule(_core.plan(src, dst, rank, 0, bool(cast)))
