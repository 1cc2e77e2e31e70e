"""A layout learnt from what an engine's own loader did.

Each parameter's content comes as the writes :mod:`reshard.engines.record`
recorded while the loader ran on storage-less stand-ins of the checkpoint:
maps from views of checkpoint tensors to views of the parameter.
:func:`read_writes` turns them into the parameter's pieces: a concat of boxes
of checkpoint tensors along dim 0, in G rounds (interleave), with padding rows
at the end of a piece; several row ranges of one checkpoint tensor (a fused
checkpoint tensor such as Phi-3's ``qkv_proj``) are pieces of their own. This
reads whole boxes at a time, so it costs the loader's operations, not the
checkpoint's elements. A parameter whose writes are no boxes in memory order
is read element by element instead (:func:`reshard.engines.record.replay`,
then :func:`read_slots`: the cost of that parameter's elements), and one whose
loader computes rather than copies is named as one the trace cannot express.

:mod:`reshard.engines.assemble` turns every rank's pieces into one layout
and checks it against the recorded writes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import Error
from . import record as rec

TAG_BASE = float(2 ** 32)
_MAX_TENSORS = 2 ** 20  # (k + 1) * 2**32 + i stays below 2**53


def tag_tensor(k: int, shape: Sequence[int]):
    """The tagged stand-in for checkpoint tensor number ``k`` (float64, torch): element ``i`` holds
    ``(k + 1) * 2**32 + i``. The element-tag trace (:func:`reshard.engines.vllm.trace_rank_tags`), kept as
    the reference the recorded trace is tested against; it costs 8 bytes per checkpoint element."""
    import torch

    if k + 1 >= _MAX_TENSORS:
        raise Error(f"trace: more than {_MAX_TENSORS - 1} checkpoint tensors cannot be tagged exactly in float64")
    n = math.prod(shape)
    if n >= 2 ** 32:
        raise Error(f"trace: a checkpoint tensor of {n} elements is too large to tag (at most 2**32 - 1)")
    return torch.arange(n, dtype=torch.float64).add_((k + 1) * TAG_BASE).reshape(tuple(shape))


@dataclasses.dataclass
class Piece:
    """One checkpoint tensor's piece inside one parameter on one rank."""
    tensor: str
    lo: List[int]      # global start per dim (real elements)
    hi: List[int]      # global end per dim, exclusive (real elements)
    extent: List[int]  # local extents, padding rows included (dim 0)
    occurrence: int = 0  # the n-th row range of this tensor in the parameter (fused checkpoint tensors)


@dataclasses.dataclass
class ParamTrace:
    """What one parameter holds on one rank: pieces in memory order, laid out in ``interleave`` rounds,
    and its slots as runs (``runs``: (first slot, count, checkpoint tensor number or -1, its first
    element's row-major index), for :func:`verify`)."""
    name: str
    dtype: str
    elements: int
    pieces: List[Piece]
    interleave: int = 1
    runs: Any = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class RankTrace:
    """One rank's part of the layout: its mesh coordinates, traced parameters, and the ones the trace
    cannot express (name -> why, and their bytes). ``slow``: parameters read element by element (name ->
    their elements)."""
    coords: Dict[str, int]
    params: List[ParamTrace]
    untraced: Dict[str, str]
    untraced_bytes: Dict[str, int]
    slow: Dict[str, int] = dataclasses.field(default_factory=dict)


# --- a parameter from its recorded writes -----------------------------------------


def _extents(lo: Sequence[int], hi: Sequence[int]) -> List[int]:
    return [h - a for a, h in zip(lo, hi)]


def _row_major(shape: Sequence[int]) -> List[int]:
    c = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        c[d] = c[d + 1] * shape[d + 1]
    return c


def box_of(view: rec.View, shape: Sequence[int]) -> Optional[Tuple[List[int], List[int]]]:
    """``(lo, hi)`` when ``view`` reaches exactly the box [lo, hi) of a row-major tensor of ``shape``, in
    row-major order; None for anything else (a transpose, a gather, a broadcast)."""
    if view.numel == 0 or any(s < 0 for s in view.strides):
        return None
    c = _row_major(shape)
    last = view.offset + sum((n - 1) * s for n, s in zip(view.sizes, view.strides))
    if last >= math.prod(shape):
        return None
    lo = [int(x) for x in np.unravel_index(view.offset, shape)] if shape else []
    hi = [int(x) + 1 for x in np.unravel_index(last, shape)] if shape else []
    if any(e <= 0 for e in _extents(lo, hi)):
        return None
    box = rec.View(view.offset, tuple(_extents(lo, hi)), tuple(c))
    if box.numel != view.numel or box.coalesced() != view.coalesced():
        return None
    return lo, hi


def _resolve(source: rec.Storage, view: rec.View) -> Optional[Tuple[rec.Storage, rec.View]]:
    """The checkpoint view behind a view of a derived storage (``.contiguous()``, ``.to(dtype)`` of a
    checkpoint view), when one write made it; None when it takes element-level replay."""
    while source.kind == "target":
        if len(source.writes) != 1 or source.writes[0].source is None:
            return None
        w = source.writes[0]
        whole, inner = w.dst.coalesced(), view.coalesced()
        run_d, run_s = w.dst.contiguous_run(), w.src.contiguous_run()
        if inner == whole:
            view = w.src
        elif run_d is not None and run_s is not None and (run := view.contiguous_run()) is not None \
                and run_d[0] <= run[0] and run[0] + run[1] <= run_d[0] + run_d[1]:
            view = rec.View(run[0] - run_d[0] + run_s[0], view.sizes, view.strides)
        else:
            return None
        source = w.source
    return source, view


def _segments(st: rec.Storage) -> "Tuple[Optional[list], str]":
    """The writes as ``(at, count, checkpoint number or -2 for a zero, lo, hi)`` in slot order, each a
    box of a checkpoint tensor in row-major order over consecutive slots; (None, "") when some write is
    not (element-level replay decides), (None, why) when the loader computes."""
    segs = []
    for w in st.writes:
        if w.source is not None and w.source.kind == "computed":
            return None, f"its loader computes values ({w.source.why})"
        run = w.dst.contiguous_run()
        if run is None:
            return None, ""
        at, n = run
        if n == 0:
            continue
        if w.source is None:
            if w.value != 0.0:
                return None, f"its loader fills it with {w.value}, no checkpoint element"
            segs.append((at, n, -2, None, None))
            continue
        found = _resolve(w.source, w.src)
        if found is None or found[0].kind != "checkpoint":
            return None, ""
        cst, view = found
        box = box_of(view, cst.shape)
        if box is None:
            return None, ""
        segs.append((at, n, cst.index, box[0], box[1]))
    segs.sort(key=lambda s: s[0])
    if any(a[0] + a[1] > b[0] for a, b in zip(segs, segs[1:])):
        return None, ""  # a later write overrides an earlier one: replay applies them in order
    return segs, ""


@dataclasses.dataclass
class _Occurrence:
    k: int
    lo: List[int]
    hi: List[int]
    at: int
    pad: int = 0


def _joined(a: _Occurrence, lo: Sequence[int], hi: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether box [lo, hi) continues ``a``'s box in row-major order into one box (then ``a`` is grown):
    they agree on every dim but one, d, where ``a`` ends as the other begins, with one index on the dims
    before d and the whole extent on the dims after it."""
    if a.pad:
        return False
    for d in range(len(shape)):
        if a.hi[d] != lo[d] or any(a.lo[e] != lo[e] or a.hi[e] != hi[e] for e in range(len(shape)) if e != d):
            continue
        if all(hi[e] - lo[e] == 1 for e in range(d)) and all(lo[e] == 0 and hi[e] == shape[e]
                                                              for e in range(d + 1, len(shape))):
            a.hi[d] = hi[d]
            return True
    return False


def _occurrences(segs, numel: int, shapes) -> "Tuple[Optional[List[_Occurrence]], str]":
    occ: List[_Occurrence] = []
    pos = 0
    for at, n, k, lo, hi in segs:
        if at > pos or k < 0:
            if not occ:
                return None, "it starts with slots that no checkpoint element fills"
            occ[-1].pad += (at - pos) + (n if k < 0 else 0)
        if k >= 0:
            if not (occ and occ[-1].k == k and _joined(occ[-1], lo, hi, shapes[k])):
                occ.append(_Occurrence(k, list(lo), list(hi), at))
            # A grown box may now continue the one before it (an expert's halves, then the expert).
            while len(occ) > 1 and occ[-2].k == occ[-1].k and _joined(occ[-2], occ[-1].lo, occ[-1].hi,
                                                                        shapes[occ[-1].k]):
                last = occ.pop()
                occ[-1].pad = last.pad
        pos = at + n
    if not occ:
        return None, "load_weights wrote none of its elements"
    occ[-1].pad += numel - pos
    return occ, ""


def _rounds(occ: List[_Occurrence]) -> int:
    """G when the occurrences are G rounds of the same tensors in the same order, each tensor's rounds
    consecutive row blocks of one box (Megatron's per-group [q; k; v]); else 1."""
    order = list(dict.fromkeys(o.k for o in occ))
    g = len(occ) // len(order)
    if len(order) < 2 or g < 2 or [o.k for o in occ] != order * g:
        return 1
    for i, k in enumerate(order):
        mine = occ[i::len(order)]
        if any(a.hi[0] != b.lo[0] or a.lo[1:] != b.lo[1:] or a.hi[1:] != b.hi[1:] for a, b in zip(mine, mine[1:])):
            return 1
    return g


def _param_from_segments(name: str, segs, numel: int, dtype: str, names, shapes) -> "Tuple[Optional[ParamTrace], str]":
    occ, why = _occurrences(segs, numel, shapes)
    if occ is None:
        return None, why
    g = _rounds(occ)
    pieces: List[Piece] = []
    if g > 1:
        if any(o.pad for o in occ):
            return None, f"its piece of '{names[occ[0].k]}' is interleaved and padded"
        order = list(dict.fromkeys(o.k for o in occ))
        for i, k in enumerate(order):
            mine = occ[i::len(order)]
            lo, hi = mine[0].lo, [mine[-1].hi[0]] + mine[0].hi[1:]
            pieces.append(Piece(names[k], lo, hi, _extents(lo, hi)))
    else:
        seen: Dict[int, int] = {}
        for o in occ:
            inner = math.prod(_extents(o.lo[1:], o.hi[1:]))
            if o.pad % inner:
                return None, f"its piece of '{names[o.k]}' has padding that is not whole rows"
            j = seen.get(o.k, 0)
            seen[o.k] = j + 1
            pieces.append(Piece(names[o.k], o.lo, o.hi, [o.hi[0] - o.lo[0] + o.pad // inner]
                                + _extents(o.lo[1:], o.hi[1:]), j))
        for o in occ:
            if seen[o.k] > 1 and any(p.lo[1:] != o.lo[1:] or p.hi[1:] != o.hi[1:] for p in occ if p.k == o.k):
                return None, f"its pieces of '{names[o.k]}' are row ranges of different columns"
    return ParamTrace(name, dtype, numel, pieces, g, _runs_of_segments(segs, shapes, numel)), ""


def _runs_of_segments(segs, shapes, numel: int):
    """The slots as runs (first slot, count, checkpoint number or -1, first index), merged."""
    rows = []
    pos = 0
    for at, n, k, lo, hi in segs:
        if at > pos:
            rows.append(np.array([[pos, at - pos, -1, -1]], dtype=np.int64))
        if k < 0:
            rows.append(np.array([[at, n, -1, -1]], dtype=np.int64))
        else:
            shape = list(shapes[k])
            box = _extents(lo, hi)
            j = len(shape) - 1
            while j > 0 and box[j] == shape[j]:
                j -= 1
            c = _row_major(shape)
            width = box[j] * c[j]
            starts = rec.view_indices(rec.View(sum(a * b for a, b in zip(lo, c)), tuple(box[:j]), tuple(c[:j])))
            r = np.empty((starts.size, 4), dtype=np.int64)
            r[:, 0] = at + np.arange(starts.size, dtype=np.int64) * width
            r[:, 1] = width
            r[:, 2] = k
            r[:, 3] = starts
            rows.append(r)
        pos = at + n
    if numel > pos:
        rows.append(np.array([[pos, numel - pos, -1, -1]], dtype=np.int64))
    return merge_runs(np.concatenate(rows) if rows else np.zeros((0, 4), dtype=np.int64))


def merge_runs(runs):
    """Runs (first slot, count, tensor or -1, first index) with each run that continues the one before
    it (the next slots, the same tensor's next elements, or padding after padding) merged into it."""
    if len(runs) < 2:
        return runs
    at, n, t, g = runs[:, 0], runs[:, 1], runs[:, 2], runs[:, 3]
    cont = (at[:-1] + n[:-1] == at[1:]) & (t[:-1] == t[1:]) & ((t[1:] < 0) | (g[:-1] + n[:-1] == g[1:]))
    first = np.concatenate(([True], ~cont))
    starts = np.flatnonzero(first)
    out = runs[starts].copy()
    out[:, 1] = np.add.reduceat(n, starts)
    return out


def read_writes(name: str, st: rec.Storage, numel: int, dtype: str, names: Sequence[str],
                shapes: Sequence[Sequence[int]]) -> "Tuple[Optional[ParamTrace], str, bool]":
    """One parameter's pieces from its recorded writes, or (None, why): box by box where every write is
    a checkpoint box over consecutive slots, else element by element (the third value says which: True
    for element by element)."""
    segs, why = _segments(st)
    if segs is not None:
        pt, why = _param_from_segments(name, segs, numel, dtype, names, shapes)
        return pt, why, False
    if why:
        return None, why, False
    ids, idx, why = rec.replay(st, numel)
    if ids is None:
        return None, why, True
    pt, why = read_slots(name, ids, idx, dtype, names, shapes)
    return pt, why, True


def read_parameter(name: str, slots: np.ndarray, dtype: str, names: Sequence[str],
                   shapes: Sequence[Sequence[int]]) -> "Tuple[Optional[ParamTrace], str]":
    """One parameter's pieces from its tagged slots (float64, flat; the element-tag trace), or (None, why)."""
    v = np.ascontiguousarray(slots, dtype=np.float64).reshape(-1)
    real = v >= TAG_BASE
    odd = int((~(real | (v == 0) | (v == -1)) | (real & (np.floor(v) != v))).sum())
    if odd:
        return None, f"its loader computes values: {odd} of {v.size} elements are no copy of a checkpoint element"
    ids = np.where(real, (v // TAG_BASE) - 1, np.where(v == 0, -2, -1)).astype(np.int64)
    idx = np.where(real, v - (ids + 1) * TAG_BASE, 0).astype(np.int64)
    return read_slots(name, ids, idx, dtype, names, shapes)


def read_slots(name: str, ids: np.ndarray, idx: np.ndarray, dtype: str, names: Sequence[str],
               shapes: Sequence[Sequence[int]]) -> "Tuple[Optional[ParamTrace], str]":
    """One parameter's pieces from its slots: per slot the checkpoint tensor number (-1 unwritten, -2 a
    written zero: padding) and the element's row-major index; or (None, why) when the loader did
    something a layout cannot say."""
    real = ids >= 0
    if not real.any():
        return None, "load_weights wrote none of its elements"
    tid = np.where(real, ids, -1)
    # Runs of one tensor (padding slots join the run before them).
    change = np.flatnonzero(np.diff(tid)) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [tid.size]))
    segs: List[List[int]] = []  # [tensor id, start, end]
    for s, e in zip(starts.tolist(), ends.tolist()):
        t = int(tid[s])
        if t < 0:
            if not segs:
                return None, "it starts with slots that no checkpoint element fills"
            segs[-1][2] = e
        elif segs and segs[-1][0] == t:
            segs[-1][2] = e
        else:
            segs.append([t, s, e])
    order: List[int] = list(dict.fromkeys(t for t, _, _ in segs))
    rounds = len(segs) // len(order)
    if rounds * len(order) != len(segs) or [t for t, _, _ in segs] != order * rounds:
        return None, "its checkpoint pieces are not laid out in equal rounds along dim 0"
    pieces = []
    for t in order:
        if t >= len(names):
            return None, f"it holds tensor number {t}, beyond the {len(names)} checkpoint tensors"
        shape = list(shapes[t])
        mine = [(s, e) for tt, s, e in segs if tt == t]
        is_real = np.concatenate([real[s:e] for s, e in mine])
        g = np.concatenate([idx[s:e] for s, e in mine])
        n_real = int(is_real.sum())
        if not is_real[:n_real].all():
            return None, f"its piece of '{names[t]}' has padding between real elements"
        if rounds > 1 and n_real != is_real.size:
            return None, f"its piece of '{names[t]}' is interleaved and padded"
        g = g[:n_real]
        if g.max() >= math.prod(shape):
            return None, f"it holds index {int(g.max())} of '{names[t]}', beyond its {math.prod(shape)} elements"
        multi = np.unravel_index(g, shape)
        lo = [int(m.min()) for m in multi]
        hi = [int(m.max()) + 1 for m in multi]
        box = _extents(lo, hi)
        view = rec.View(sum(a * b for a, b in zip(lo, _row_major(shape))), tuple(box), tuple(_row_major(shape)))
        if math.prod(box) != n_real or not np.array_equal(rec.view_indices(view), g):
            return None, f"its piece of '{names[t]}' is not a box of the tensor in row-major order (a transpose or a gather)"
        inner = math.prod(box[1:])
        if is_real.size % inner:
            return None, f"its piece of '{names[t]}' has padding that is not whole rows"
        pieces.append(Piece(names[t], lo, hi, [is_real.size // inner] + box[1:]))
    return ParamTrace(name, dtype, int(ids.size), pieces, rounds, _runs_of_slots(ids, idx)), ""


def _runs_of_slots(ids: np.ndarray, idx: np.ndarray):
    t = np.where(ids >= 0, ids, -1)
    g = np.where(ids >= 0, idx, -1)
    n = np.ones(t.size, dtype=np.int64)
    return merge_runs(np.stack([np.arange(t.size, dtype=np.int64), n, t, g], axis=1))
