"""The whole layout from every rank's trace, and its check against what the loader wrote.

:func:`assemble` turns every rank's pieces (:mod:`reshard.engines.trace`)
into one layout (CONTRACT.md section 1): per tensor and dim, which mesh axes
(or sub-axes) cut it, the parts' sizes and padding, the stage coordinates of
the ranks that hold it; per parameter, a concat buffer named as the engine
names it; row ranges of a fused checkpoint tensor as tensors with ``rows_of``
(:mod:`reshard.engines.rows`). :func:`verify_rank` then checks, run by run of
slots, that the layout reproduces what the loader wrote on a rank; :func:`verify_traces` does so for
traced ranks (the engines' one check, whether every rank is traced in one process or each in its own).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .. import Error, Layout, layout_from_json
from . import rows
from .trace import ParamTrace, Piece, RankTrace, merge_runs


def _positions(axes: Sequence[Tuple[str, int]]) -> List[Dict[str, int]]:
    out = [{}]
    for name, size in axes:
        out = [dict(c, **{name: i}) for c in out for i in range(size)]
    return out


def position(axes: Sequence[Tuple[str, int]], coords: Mapping[str, int]) -> int:
    """A mesh position (row-major over ``axes``, slowest first) from its coordinates."""
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
                return value(position(axes, q))
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
        p = position(axes, tr.coords)
        if p in by_pos:
            raise Error(f"{origin}: two ranks at mesh coordinates {tr.coords}")
        by_pos[p] = tr
    if len(by_pos) != len(positions):
        raise Error(f"{origin}: {len(by_pos)} rank traces for a mesh of {len(positions)} positions")
    # Row ranges of fused checkpoint tensors: tensors of their own.
    rows_of = rows.name_row_ranges([pt for tr in by_pos.values() for pt in tr.params], shapes, origin)
    if rows_of:
        shapes = dict(shapes)
        for new, (base, a, b) in rows_of.items():
            shapes[new] = [b - a] + list(shapes[base])[1:]
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
    # In the checkpoint's order (a fused tensor's row ranges where it stands): the planner balances
    # replicated sends in the order of the destination's tensors.
    order = {n: i for i, n in enumerate(shapes)}
    for new, (base, a, _) in rows_of.items():
        order[new] = order[base] + a / (1 + shapes[base][0] if base in shapes else 1)
    tensors = [_tensor_entry(t, list(shapes[t]), dtype_of[t], held[t], axes, positions)
               for t in sorted(held, key=lambda n: (order.get(n, len(order)), n))]
    for e in tensors:
        if e["name"] in rows_of:
            base, a, _ = rows_of[e["name"]]
            e["rows_of"] = {"tensor": base, "start": a}
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


def checkpoint_coordinates(layout: Layout, index: Mapping[str, int]):
    """Per layout tensor (by its index in ``layout.tensors``; the last entry for padding): its checkpoint
    tensor number (-3 for none) and the shift of its row-major indices into that tensor's (a ``rows_of``
    tensor's rows are its base tensor's). Computed once per layout for :func:`verify`."""
    names = layout.tensors
    ids = np.full(len(names) + 1, -1, dtype=np.int64)
    shift = np.zeros(len(names) + 1, dtype=np.int64)
    for i, n in enumerate(names):
        ids[i] = index.get(n, -3)
        if n not in index:
            info = layout.tensor(n)
            if info.get("rows_of"):
                base, start = info["rows_of"]
                ids[i] = index.get(base, -3)
                shift[i] = start * math.prod(info["shape"][1:])
    return ids, shift


def verify_traces(layout: Layout, traces: Sequence[RankTrace], checkpoint, first_rank: int,
                  checked: Optional[Sequence[RankTrace]] = None) -> Optional[str]:
    """:func:`verify_rank` for the ranks of ``checked`` (default: all of ``traces``), on their parameters
    that no rank of ``traces`` left untraced, in the coordinates of ``checkpoint`` ((name, shape, dtype)
    in the checkpoint's order): the first rank whose recorded writes the layout does not reproduce, in
    words, or None."""
    coordinates = checkpoint_coordinates(layout, {e[0]: k for k, e in enumerate(checkpoint)})
    untraced = set().union(*(t.untraced for t in traces))
    for t in traces if checked is None else checked:
        rank = first_rank + position(layout.mesh, t.coords)
        why = verify_rank(layout, rank, [pt for pt in t.params if pt.name not in untraced], coordinates)
        if why:
            return f"rank {rank}: the traced layout does not reproduce vLLM's loader on {why}"
    return None


def verify_rank(layout: Layout, rank: int, params: Sequence[ParamTrace], coordinates) -> Optional[str]:
    """:func:`verify` for all of a rank's traced parameters (the layout's runs asked once): the first
    parameter that differs, with what differs, or None."""
    runs = layout.slot_runs(rank, columns=True)
    for pt in params:
        if pt.name not in runs:
            return f"parameter '{pt.name}': the layout gives rank {rank} no buffer of that name"
        why = verify(layout, rank, pt, coordinates, runs[pt.name])
        if why:
            return f"parameter '{pt.name}': {why}"
    return None


def verify(layout: Layout, rank: int, param: ParamTrace, coordinates, runs=None) -> Optional[str]:
    """None when ``layout`` puts on ``rank`` exactly what the loader wrote into ``param`` (every slot: the
    same checkpoint element, or padding where the loader wrote 0 or nothing), else what differs. Compared
    run by run: the layout's slot runs (``runs``, else asked of the layout), in checkpoint coordinates
    (:func:`checkpoint_coordinates`), against the recorded ones."""
    ids, shift = coordinates
    want = layout.slot_runs(rank, param.name, columns=True) if runs is None else runs
    t = want[:, 2]
    want = np.stack([want[:, 0], want[:, 1], ids[t], np.where(t >= 0, want[:, 3] + shift[t], -1)], axis=1)
    want = merge_runs(want[np.argsort(want[:, 0], kind="stable")])
    got = param.runs
    end = int(want[-1, 0] + want[-1, 1]) if len(want) else 0
    if end != param.elements:
        return f"the layout's buffer has {end} slots, the parameter {param.elements}"
    if want.shape == got.shape and np.array_equal(want, got):
        return None
    k = 0
    while k < min(len(want), len(got)) and np.array_equal(want[k], got[k]):
        k += 1
    w = tuple(int(x) for x in want[k]) if k < len(want) else None
    g = tuple(int(x) for x in got[k]) if k < len(got) else None
    return f"from slot {(w or g)[0]} the layout says (slot, count, tensor number, index) {w}, the loader wrote {g}"
