"""Row ranges of fused checkpoint tensors as tensors of their own (``rows_of``, docs/contract-extensions.md).

Some checkpoints fuse what an engine keeps apart on each rank: Phi-3's
``qkv_proj.weight`` is ``[q; k; v]`` whole, while vLLM's rank r holds
``[q_r; k_r; v_r]``, three row ranges of it. A layout tensor is cut over mesh
axes as one box per rank, so the trace names each range of rows a tensor of its
own, ``NAME[a:b]`` with ``"rows_of": {"tensor": NAME, "start": a}``, and a
source that holds ``NAME`` whole (or cut along other dims, or in contiguous
parts along rows) is split the same way by :func:`split_rows` before planning.
"""
from __future__ import annotations

import json
from typing import Dict, List, Mapping, Sequence, Tuple

from .. import Error, Layout, layout_from_json


def range_name(base: str, a: int, b: int) -> str:
    return f"{base}[{a}:{b}]"


def name_row_ranges(params: Sequence, shapes: Mapping[str, Sequence[int]], origin: str) -> Dict[str, Tuple[str, int, int]]:
    """Renames, in place, the pieces of checkpoint tensors that land in a parameter as several row ranges
    (:class:`reshard.engines.trace.Piece` ``occurrence`` > 0 on some rank): the n-th range of every rank
    is one tensor, rows [a, b) of the checkpoint tensor over all ranks. Returns new name -> (base, a, b)."""
    fused = {pc.tensor for pt in params for pc in pt.pieces if pc.occurrence > 0}
    ranges: Dict[Tuple[str, int], List[int]] = {}
    for pt in params:
        for pc in pt.pieces:
            if pc.tensor in fused:
                r = ranges.setdefault((pc.tensor, pc.occurrence), [pc.lo[0], pc.hi[0]])
                r[0], r[1] = min(r[0], pc.lo[0]), max(r[1], pc.hi[0])
    out: Dict[str, Tuple[str, int, int]] = {}
    for base in sorted(fused):
        mine = sorted((a, b, j) for (t, j), (a, b) in ranges.items() if t == base)
        for (a0, b0, j0), (a1, b1, j1) in zip(mine, mine[1:]):
            if a1 < b0:
                raise Error(f"{origin}: checkpoint tensor '{base}': its row ranges {j0} [{a0}, {b0}) and {j1} "
                            f"[{a1}, {b1}) overlap across ranks (ranks fuse its rows differently)")
        for a, b, _ in mine:
            out[range_name(base, a, b)] = (base, a, b)
        if mine[0][0] != 0 or mine[-1][1] != shapes[base][0] or any(x[1] != y[0] for x, y in zip(mine, mine[1:])):
            cover = ", ".join(f"[{a}, {b})" for a, b, _ in mine)
            raise Error(f"{origin}: checkpoint tensor '{base}' ({shapes[base][0]} rows): its row ranges {cover} do "
                        f"not cover it")
    by_range = {(base, j): ranges[(base, j)] for base, j in ranges}
    for pt in params:
        for pc in pt.pieces:
            if pc.tensor in fused:
                a, b = by_range[(pc.tensor, pc.occurrence)]
                pc.tensor = range_name(pc.tensor, a, b)
                pc.lo[0] -= a
                pc.hi[0] -= a
                pc.occurrence = 0
    return out


def split_rows(src: Layout, dst: Layout) -> Layout:
    """``src`` with each checkpoint tensor that ``dst`` splits into row ranges (``rows_of``) split the same
    way, so the two plan against each other; ``src`` itself when there is none. The ranges keep the
    tensor's memory on every rank: a tensor stored alone becomes a concat buffer of its ranges (dim 0),
    and its place in a concat (dim 0, one round) or flat buffer is taken by its ranges in order. Along
    rows the tensor may be whole or cut in contiguous parts (each range then cut where they fall)."""
    want: Dict[str, List[Tuple[str, int, int]]] = {}
    src_names = set(src.tensors)
    for n in dst.tensors:
        ro = dst.tensor(n).get("rows_of")
        if ro and n not in src_names:
            want.setdefault(ro[0], []).append((n, ro[1], ro[1] + dst.tensor(n)["shape"][0]))
    if not want:
        return src
    doc = json.loads(src.to_json())
    where = f"{src.origin}: splitting fused checkpoint tensors for {dst.origin}"
    sizes = dict(doc["mesh"]["axes"])
    tensors = {t["name"]: t for t in doc["tensors"]}
    new_tensors: List[dict] = []
    for t in doc["tensors"]:
        if t["name"] not in want:
            new_tensors.append(t)
            continue
        ranges = sorted(want[t["name"]], key=lambda r: r[1])
        if ranges[0][1] != 0 or ranges[-1][2] != t["shape"][0] or any(x[2] != y[1] for x, y in zip(ranges, ranges[1:])):
            raise Error(f"{where}: the destination's row ranges of '{t['name']}' do not cover its {t['shape'][0]} rows")
        parts = _row_parts(t, sizes, where)
        for name, a, b in ranges:
            r = {k: v for k, v in t.items() if k != "quant"}
            r.update(name=name, shape=[b - a] + t["shape"][1:], rows_of={"tensor": t["name"], "start": a})
            if parts is not None:
                spec = dict(t["dims"][0]) if isinstance(t["dims"][0], dict) else {"axes": _axes(t["dims"][0])}
                spec.pop("pad_to", None)
                spec["split"] = [max(0, min(b, hi) - max(a, lo)) for lo, hi in parts]
                r["dims"] = [spec] + list(t["dims"][1:])
            new_tensors.append(r)
    doc["tensors"] = new_tensors
    buffers = []
    in_buffer = set()
    for b in doc.get("buffers", []):
        for p in b["parts"]:
            if p in want:
                if "flat" not in b and (b.get("dim", 0) != 0 or b.get("interleave", 1) != 1):
                    raise Error(f"{where}: '{p}' is in buffer '{b['name']}' along dim {b.get('dim', 0)} in "
                                f"{b.get('interleave', 1)} rounds; only a dim-0, one-round concat or a flat buffer "
                                f"can take its row ranges")
                in_buffer.add(p)
        b["parts"] = [n for p in b["parts"] for n in ([r[0] for r in sorted(want[p], key=lambda r: r[1])]
                                                      if p in want else [p])]
        buffers.append(b)
    for base in want:
        if base not in in_buffer and base in tensors:
            buffers.append({"name": base, "parts": [r[0] for r in sorted(want[base], key=lambda r: r[1])], "dim": 0})
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise Error(f"{where}: the source has no tensor '{missing[0]}' (the destination holds rows of it)")
    doc["buffers"] = buffers
    return layout_from_json(json.dumps(doc), src.origin)


def _axes(spec) -> list:
    return [spec] if isinstance(spec, str) else list(spec)


def _row_parts(t: dict, sizes: Mapping[str, int], where: str):
    """The row ranges [lo, hi) of the parts of ``t``'s dim 0 in part order, or None when rows are not cut."""
    dims = t.get("dims") or [None] * len(t["shape"])
    spec = dims[0]
    if spec is None:
        return None
    if not isinstance(spec, dict):
        spec = {"axes": _axes(spec)}
    if "cyclic" in spec:
        raise Error(f"{where}: '{t['name']}' is cut cyclically along rows; its row ranges cannot follow")
    k = 1
    for a in spec.get("axes", []):
        k *= a["size"] if isinstance(a, dict) and "size" in a else \
            sizes[a if isinstance(a, str) else a["axis"]] // (a.get("stride", 1) if isinstance(a, dict) else 1)
    n = t["shape"][0]
    padded = spec.get("pad_to", n)
    split = spec.get("split", "even")
    if isinstance(split, list):
        cuts = split
    elif split == "even":
        cuts = [padded // k] * k
    elif split == "chunk":
        q = -(-padded // k)
        cuts = [max(0, min(padded, (p + 1) * q) - p * q) for p in range(k)]
    else:  # balanced
        cuts = [padded // k + (1 if p < padded % k else 0) for p in range(k)]
    out, at = [], 0
    for c in cuts:
        out.append((min(at, n), min(at + c, n)))
        at += c
    return out
