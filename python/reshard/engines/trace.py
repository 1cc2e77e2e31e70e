"""A layout learnt from memory that an engine's own loader filled.

Each checkpoint tensor is handed to the loader as a *tagged* tensor: element
``i`` of tensor ``k`` holds ``(k + 1) * 2**32 + i`` in float64 (exact up to
2**53), and every parameter is swapped for a float64 array of ``-1``. After the
loader ran, each slot of each parameter says which checkpoint element landed
there (a copy), that the loader wrote a zero (padding, as vLLM pads its
vocabulary), that nothing wrote it (-1), or something else: the loader
computes (a transform, a scale), and the parameter is named as one the trace
cannot express.

:func:`read_parameter` turns one parameter's slots into its pieces: a concat
of boxes of checkpoint tensors along dim 0, in G rounds (interleave), with
padding rows at the end of a piece. :func:`assemble` turns every rank's
pieces into one layout (CONTRACT.md section 1): per tensor and dim, which
mesh axes (or sub-axes) cut it, the parts' sizes and padding, the stage
coordinates of the ranks that hold it; per parameter, a concat buffer named as
the engine names it. :func:`verify` then checks, slot by slot, that the
layout reproduces what the loader did on this rank.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .. import Error, Layout, layout_from_json

TAG_BASE = float(2 ** 32)
_MAX_TENSORS = 2 ** 20  # (k + 1) * 2**32 + i stays below 2**53


def tag_tensor(k: int, shape: Sequence[int]):
    """The tagged stand-in for checkpoint tensor number ``k`` (float64, torch)."""
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


@dataclasses.dataclass
class ParamTrace:
    """What one parameter holds on one rank: pieces in memory order, laid out in ``interleave`` rounds."""
    name: str
    dtype: str
    elements: int
    pieces: List[Piece]
    interleave: int = 1


@dataclasses.dataclass
class RankTrace:
    """One rank's part of the layout: its mesh coordinates, traced parameters, and the ones the trace
    cannot express (name -> why, and their bytes)."""
    coords: Dict[str, int]
    params: List[ParamTrace]
    untraced: Dict[str, str]
    untraced_bytes: Dict[str, int]


def read_parameter(name: str, slots: np.ndarray, dtype: str, names: Sequence[str],
                   shapes: Sequence[Sequence[int]]) -> "Tuple[Optional[ParamTrace], str]":
    """One parameter's pieces from its tagged slots (float64, flat), or (None, why) when the loader did
    something a layout cannot say. ``names`` / ``shapes``: the checkpoint tensors by tag number."""
    v = np.ascontiguousarray(slots, dtype=np.float64).reshape(-1)
    real = v >= TAG_BASE
    padding = (v == 0) | (v == -1)
    odd = ~(real | padding) | (real & (np.floor(v) != v))
    if odd.any():
        return None, (f"its loader computes values: {int(odd.sum())} of {v.size} elements are no copy of a "
                      f"checkpoint element")
    if not real.any():
        return None, "load_weights wrote none of its elements"
    ids = np.full(v.size, -1, dtype=np.int64)
    ids[real] = (v[real] // TAG_BASE).astype(np.int64) - 1
    # Runs of one tensor (padding slots join the run before them).
    change = np.flatnonzero(np.diff(ids)) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [v.size]))
    segs: List[List[int]] = []  # [tensor id, start, end]
    for s, e in zip(starts.tolist(), ends.tolist()):
        t = int(ids[s])
        if t < 0:
            if not segs:
                return None, "it starts with slots that no checkpoint element fills"
            segs[-1][2] = e
        elif segs and segs[-1][0] == t:
            segs[-1][2] = e
        else:
            segs.append([t, s, e])
    order: List[int] = []
    for t, _, _ in segs:
        if t not in order:
            order.append(t)
    rounds = len(segs) // len(order)
    if rounds * len(order) != len(segs) or [t for t, _, _ in segs] != order * rounds:
        return None, "its checkpoint pieces are not laid out in equal rounds along dim 0"
    pieces = []
    for t in order:
        if t >= len(names):
            return None, f"it holds tag {t}, beyond the {len(names)} checkpoint tensors"
        shape = list(shapes[t])
        mine = [(s, e) for tt, s, e in segs if tt == t]
        idx = np.concatenate([v[s:e] for s, e in mine])
        is_real = idx >= TAG_BASE
        n_real = int(is_real.sum())
        if not is_real[:n_real].all():
            return None, f"its piece of '{names[t]}' has padding between real elements"
        if rounds > 1 and n_real != idx.size:
            return None, f"its piece of '{names[t]}' is interleaved and padded"
        g = (idx[:n_real] - (t + 1) * TAG_BASE).astype(np.int64)
        if g.max() >= math.prod(shape):
            return None, f"it holds index {int(g.max())} of '{names[t]}', beyond its {math.prod(shape)} elements"
        multi = np.unravel_index(g, shape)
        lo = [int(m.min()) for m in multi]
        hi = [int(m.max()) + 1 for m in multi]
        box = [h - l for l, h in zip(lo, hi)]
        # The piece must be the box [lo, hi) in row-major order.
        strides = np.cumprod([1] + shape[::-1][:-1])[::-1]
        expect = np.zeros(box, dtype=np.int64) if box else np.zeros((), dtype=np.int64)
        for d in range(len(shape)):
            sh = [1] * len(shape)
            sh[d] = box[d]
            expect = expect + ((np.arange(box[d]) + lo[d]) * int(strides[d])).reshape(sh)
        if math.prod(box) != n_real or not np.array_equal(expect.reshape(-1), g):
            return None, f"its piece of '{names[t]}' is not a box of the tensor in row-major order (a transpose or a gather)"
        inner = math.prod(box[1:])
        if idx.size % inner:
            return None, f"its piece of '{names[t]}' has padding that is not whole rows"
        pieces.append(Piece(names[t], lo, hi, [idx.size // inner] + box[1:]))
    return ParamTrace(name, dtype, int(v.size), pieces, rounds), ""


# --- the whole layout from every rank's part ------------------------------------


def _positions(axes: Sequence[Tuple[str, int]]) -> List[Dict[str, int]]:
    out = [{}]
    for name, size in axes:
        out = [dict(c, **{name: i}) for c in out for i in range(size)]
    return out


def _pos_of(axes, coords) -> int:
    p = 0
    for name, size in axes:
        p = p * size + coords[name]
    return p


def _sub_axis(axis: str, size: int, value_of, where: str):
    """How a dim's part depends on one axis's coordinate c: the sub-axis (stride s, size z) whose digit
    (c / s) % z picks it, or None when it does not depend on c."""
    vals = [value_of(c) for c in range(size)]
    if all(x == vals[0] for x in vals):
        return None
    s = 1
    while s < size and vals[s] == vals[0]:
        s += 1
    distinct = []
    for c in range(0, size, s):
        if vals[c] not in distinct:
            distinct.append(vals[c])
    z = len(distinct)
    if size % (s * z) or any(vals[c] != distinct[(c // s) % z] for c in range(size)):
        raise Error(f"{where}: the part held depends on mesh axis '{axis}' in a way no (sub-)axis expresses "
                    f"(by coordinate: {vals})")
    return s, z


def _tensor_entry(name: str, shape: List[int], dtype: str, held: Dict[int, Piece], axes, positions) -> dict:
    where = f"tensor '{name}'"
    # Stage: the holders must be a product of whole axes and single coordinates.
    stage = {}
    for a, size in axes:
        cs = sorted({positions[p][a] for p in held})
        if len(cs) == 1 and size > 1:
            stage[a] = cs[0]
        elif len(cs) != size:
            raise Error(f"{where}: held on coordinates {cs} of mesh axis '{a}' (size {size}): neither one "
                        f"stage nor the whole axis")
    n_holders = math.prod(size for a, size in axes if a not in stage)
    if len(held) != n_holders:
        raise Error(f"{where}: held by {len(held)} ranks, not a product of mesh axes")
    free = [(a, size) for a, size in axes if a not in stage and size > 1]
    dims = []
    for d, n in enumerate(shape):
        def value(p, d=d):
            pc = held[p]
            return (pc.lo[d], pc.hi[d], pc.extent[d])
        refs = []
        for a, size in free:
            base = {b: 0 for b, _ in axes}
            base.update(stage)

            def value_of(c, a=a, base=base):
                q = dict(base, **{a: c})
                return value(_pos_of(axes, q))
            sub = _sub_axis(a, size, value_of, f"{where} dim {d}")
            if sub is not None:
                refs.append((a, size, sub[0], sub[1]))
        k = math.prod(z for _, _, _, z in refs)
        parts: Dict[int, Tuple[int, int, int]] = {}
        for p, pc in held.items():
            c = positions[p]
            idx = 0
            for a, size, s, z in refs:
                idx = idx * z + (c[a] // s) % z
            val = value(p)
            if parts.setdefault(idx, val) != val:
                raise Error(f"{where} dim {d}: ranks with the same part index {idx} hold different pieces "
                            f"({parts[idx]} and {val}): not a cut over mesh axes")
        if len(parts) != k:
            raise Error(f"{where} dim {d}: {len(parts)} distinct pieces for {k} parts")
        sizes, off = [], 0
        for i in range(k):
            lo, hi, ext = parts[i]
            if hi > lo and (lo != off or hi != min(n, off + ext)):
                raise Error(f"{where} dim {d}: part {i} holds [{lo}, {hi}) where a contiguous cut puts "
                            f"[{off}, {min(n, off + ext)})")
            if hi <= lo and off < n:
                raise Error(f"{where} dim {d}: part {i} holds no element but starts at {off} < {n}")
            sizes.append(ext)
            off += ext
        if off < n:
            raise Error(f"{where} dim {d}: the parts cover {off} of {n} indices")
        spec: Dict[str, Any] = {}
        if refs:
            spec["axes"] = [a if (s == 1 and z == size) else {"axis": a, "stride": s, "size": z}
                            for a, size, s, z in refs]
            if not (off % k == 0 and all(x == off // k for x in sizes)):
                spec["split"] = sizes
        if off > n:
            spec["pad_to"] = off
        dims.append(spec or None)
    entry = {"name": name, "shape": list(shape), "dtype": dtype, "dims": dims}
    if stage:
        entry["stage"] = stage
    return entry


def assemble(traces: Sequence[RankTrace], axes: Sequence[Tuple[str, int]], shapes: Mapping[str, Sequence[int]], *,
             first_rank: int = 0, origin: str = "traced layout") -> "Tuple[dict, Layout]":
    """The layout JSON (and the validated Layout) of every rank's trace; ``traces`` in any order (each
    carries its coordinates), ``axes`` the mesh's ``(name, size)`` pairs, slowest first."""
    axes = [(a, int(s)) for a, s in axes]
    positions = _positions(axes)
    by_pos: Dict[int, RankTrace] = {}
    for tr in traces:
        p = _pos_of(axes, tr.coords)
        if p in by_pos:
            raise Error(f"{origin}: two ranks at mesh coordinates {tr.coords}")
        by_pos[p] = tr
    if len(by_pos) != len(positions):
        raise Error(f"{origin}: {len(by_pos)} rank traces for a mesh of {len(positions)} positions")
    # Untraced on any rank: left out everywhere (one path per parameter name).
    untraced = set()
    for tr in by_pos.values():
        untraced |= set(tr.untraced)
    held: Dict[str, Dict[int, Piece]] = {}
    dtype_of: Dict[str, str] = {}
    owner: Dict[str, str] = {}
    param_parts: Dict[str, List[str]] = {}
    param_rounds: Dict[str, int] = {}
    for p in sorted(by_pos):
        for pt in by_pos[p].params:
            if pt.name in untraced:
                continue
            seq = [pc.tensor for pc in pt.pieces]
            merged = param_parts.setdefault(pt.name, [])
            for t in seq:
                if t not in merged:
                    merged.append(t)
            if [t for t in merged if t in seq] != seq:
                raise Error(f"{origin}: parameter '{pt.name}' holds its tensors in another order on rank "
                            f"{first_rank + p} ({seq})")
            if param_rounds.setdefault(pt.name, pt.interleave) != pt.interleave:
                raise Error(f"{origin}: parameter '{pt.name}' interleaves {pt.interleave} rounds on rank "
                            f"{first_rank + p}, {param_rounds[pt.name]} elsewhere")
            for pc in pt.pieces:
                if owner.setdefault(pc.tensor, pt.name) != pt.name:
                    raise Error(f"{origin}: checkpoint tensor '{pc.tensor}' lands in two parameters, "
                                f"'{owner[pc.tensor]}' and '{pt.name}'")
                if p in held.get(pc.tensor, {}):
                    raise Error(f"{origin}: '{pc.tensor}' is in parameter '{pt.name}' twice on rank {first_rank + p}")
                held.setdefault(pc.tensor, {})[p] = pc
                if dtype_of.setdefault(pc.tensor, pt.dtype) != pt.dtype:
                    raise Error(f"{origin}: '{pc.tensor}' lands in parameters of dtype {dtype_of[pc.tensor]} and {pt.dtype}")
    tensors = [_tensor_entry(t, list(shapes[t]), dtype_of[t], held[t], axes, positions) for t in sorted(held)]
    buffers = []
    for name, parts in param_parts.items():
        if len(parts) == 1 and parts[0] == name and param_rounds[name] == 1:
            continue  # stored alone under its own name
        b = {"name": name, "parts": parts, "dim": 0}
        if param_rounds[name] > 1:
            b["interleave"] = param_rounds[name]
        buffers.append(b)
    doc = {"mesh": {"axes": [[a, s] for a, s in axes], "first_rank": first_rank}, "tensors": tensors,
           "buffers": buffers}
    return doc, layout_from_json(doc, origin)


def verify(layout: Layout, rank: int, param: ParamTrace, slots: np.ndarray, index: Mapping[str, int]) -> Optional[str]:
    """None when ``layout`` puts on ``rank`` exactly what the loader put in ``param`` (every slot: the
    same checkpoint element, or padding where the loader wrote 0 or nothing), else what differs."""
    v = np.ascontiguousarray(slots, dtype=np.float64).reshape(-1)
    expect = np.full(v.size, -1.0)
    covered = np.zeros(v.size, dtype=bool)
    for at, n, tensor, g in layout.slot_runs(rank, param.name):
        if at + n > v.size:
            return f"the layout's buffer has {at + n} slots or more, the parameter {v.size}"
        covered[at:at + n] = True
        if tensor is not None:
            expect[at:at + n] = (index[tensor] + 1) * TAG_BASE + g + np.arange(n)
    real = expect >= 0
    bad = (real & (v != expect)) | (~real & (v >= TAG_BASE))
    if not covered.all():
        return f"{int((~covered).sum())} of its {v.size} slots are in no piece of the layout"
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return f"slot {i} holds tag {v[i]:.0f}, the layout says {expect[i]:.0f} ({int(bad.sum())} slots differ)"
    return None
