"""A trainer's layout read from its DTensor parameters (FSDP2, torch tensor parallel).

FSDP2 / DTensor trainers (veRL, SkyRL, TRL, torchtitan) carry their layout
exactly in each parameter: a ``DeviceMesh`` (global ranks, dim names) and one
placement per mesh dim. :func:`dtensor_layout` turns them into a layout
(CONTRACT.md section 1) that every rank builds alike with no exchange:

* the mesh's dims become axes (``mesh_dim_names``, else ``mesh0``, ``mesh1``...),
  its global ranks the layout's ``ranks`` (offset by ``first_rank``);
* ``Shard(d)`` on mesh dim i cuts tensor dim d over axis i with torch.chunk
  semantics (``"split": "chunk"``: FSDP2's uneven shards); several mesh dims
  sharding one tensor dim cut it in mesh-dim order, chunk within chunk
  (explicit part sizes); ``Replicate()`` replicates;
* each parameter is a tensor stored alone under its own name (HuggingFace names
  for HF models), its local shard (``to_local()``) the rank's buffer, bound in
  place.

``Partial`` and ``_StridedShard`` placements (FSDP2 over tensor parallel) are
refused, naming the parameter. The dtype is the parameter's: an f32 master copy
refits into bf16 destinations with ``Resharder(..., cast=True)``.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence, Tuple

from .. import Error, Layout, layout_from_json
from .vllm import reshard_dtype


def _chunk_sizes(n: int, k: int) -> List[int]:
    q = -(-n // k) if n else 0
    return [max(0, min(n, (p + 1) * q) - p * q) for p in range(k)]


def _nested_chunk_sizes(n: int, ks: List[int]) -> List[int]:
    """Part sizes of a dim chunked by ks[0], then each part by ks[1], ... (mixed radix, first major)."""
    sizes = [n]
    for k in ks:
        sizes = [s for part in sizes for s in _chunk_sizes(part, k)]
    return sizes


def placement_layout(params: Iterable[Tuple[str, Sequence[int], str, Sequence[Tuple[str, int]]]],
                     axes: Sequence[Tuple[str, int]], ranks: Sequence[int], *, origin: str) -> Layout:
    """A layout from per-parameter placements on one mesh: ``params`` are ``(name, shape, dtype,
    placements)`` with one ``("shard", dim)`` or ``("replicate", 0)`` per mesh axis (DTensor's and
    vLLM's ``ParamMeta`` semantics: torch.chunk, outer mesh axis first when two shard one dim)."""
    tensors = []
    for name, shape, dtype, placements in params:
        shape = list(shape)
        if len(placements) != len(axes):
            raise Error(f"{origin}: parameter '{name}' has {len(placements)} placements for a "
                        f"{len(axes)}-D mesh")
        cuts: Dict[int, List[int]] = {}
        for i, (kind, d) in enumerate(placements):
            if kind == "shard":
                if not -len(shape) <= d < len(shape):
                    raise Error(f"{origin}: parameter '{name}' shards dim {d} of a {len(shape)}-D tensor")
                cuts.setdefault(d % len(shape), []).append(i)
            elif kind != "replicate":
                raise Error(f"{origin}: parameter '{name}' has placement {kind} on mesh dim {i} "
                            f"({axes[i][0]}): only Shard(d) and Replicate() are read")
        dims = []
        for d, n in enumerate(shape):
            if d not in cuts:
                dims.append(None)
                continue
            ks = [axes[i][1] for i in cuts[d]]
            dims.append({"axes": [axes[i][0] for i in cuts[d]],
                         "split": "chunk" if len(ks) == 1 else _nested_chunk_sizes(n, ks)})
        tensors.append({"name": name, "shape": shape, "dtype": dtype, "dims": dims})
    if not tensors:
        raise Error(f"{origin}: no parameters")
    doc = {"mesh": {"axes": [[a, int(s)] for a, s in axes], "ranks": [int(r) for r in ranks]},
           "tensors": tensors, "buffers": []}
    return layout_from_json(doc, origin)


def dtensor_layout(named: Iterable[Tuple[str, Any]], *, first_rank: int = 0,
                   origin: str = "dtensor layout") -> "Tuple[Layout, Dict[str, Any]]":
    """The layout of a module's DTensor parameters and this rank's buffers (their local shards).

    ``named``: ``model.named_parameters()`` (FSDP2-wrapped names are the
    module's own). Every parameter must be a DTensor on one mesh.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = None
    params, bufs = [], {}
    for name, p in named:
        if not isinstance(p, DTensor):
            raise Error(f"{origin}: parameter '{name}' is a plain tensor, not a DTensor (wrap the whole module)")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise Error(f"{origin}: parameter '{name}' lives on another device mesh than the others")
        placements = []
        for i, pl in enumerate(p.placements):
            placements.append(("shard", pl.dim) if type(pl) is Shard else
                              ("replicate", 0) if isinstance(pl, Replicate) else (str(pl), 0))
        params.append((name, list(p.shape), reshard_dtype(p.dtype), placements))
        local = p.to_local()
        if local.numel() and not local.is_contiguous():
            raise Error(f"{origin}: parameter '{name}': its local shard is not contiguous")
        bufs[name] = local.detach()
    if mesh is None:
        raise Error(f"{origin}: no parameters")
    names = mesh.mesh_dim_names or tuple(f"mesh{i}" for i in range(mesh.ndim))
    axes = [(a, int(mesh.size(i))) for i, a in enumerate(names)]
    layout = placement_layout(params, axes, [first_rank + int(r) for r in mesh.mesh.flatten().tolist()],
                              origin=origin)
    held = {b["name"] for b in layout.buffers(first_rank + int(mesh.get_rank()))}
    return layout, {n: t for n, t in bufs.items() if n in held}
