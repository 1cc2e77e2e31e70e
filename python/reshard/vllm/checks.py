"""The backend's setup checks: the trainer's layout from vLLM's parameter metadata, the trainer's checkpoint
against the engine's model config, and the words of errors (which reshard ranks are whose)."""
from __future__ import annotations

import re
from typing import Any, List, Sequence, Tuple

from vllm.distributed.weight_transfer.base import ParamMeta, Replicate, Shard

from .. import Error, Layout
from ..engines.dtensor import placement_layout
from ..engines.vllm import reshard_dtype


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


def with_legend(e: Error, legend: str) -> Error:
    try:
        out = type(e)(f"{e} [{legend}]")
    except TypeError:
        return Error(f"{e} [{legend}]")
    for k in ("written", "partial", "untouched"):  # RefitNotCommitted's report of this rank's memory
        if hasattr(e, k):
            setattr(out, k, getattr(e, k))
    return out


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


#: The vLLM release this backend targets: its weight-transfer API, and the loaders the trace follows.
TARGET_VLLM = "0.33"


def check_vllm_version(installed: str) -> None:
    """Refuses a vLLM other than the targeted release (any 0.33.x), naming both versions."""
    if installed.split("+")[0].split(".")[:2] != TARGET_VLLM.split("."):
        raise Error(f"reshard backend: vLLM {installed} is installed, this backend targets vLLM {TARGET_VLLM}.x "
                    f"(its weight-transfer API and the loaders it traces): install vllm=={TARGET_VLLM}.*")


def check_parallel_config(parallel_config: Any) -> None:
    """Refuses what the backend does not refit yet: EPLB's redundant experts (vLLM moves experts between
    ranks at run time, so a traced layout would not hold)."""
    eplb = getattr(parallel_config, "enable_eplb", False)
    redundant = getattr(getattr(parallel_config, "eplb_config", None), "num_redundant_experts", 0) or 0
    if eplb or redundant:
        raise Error(f"reshard backend: enable_eplb={eplb} (num_redundant_experts={redundant}): expert-parallel "
                    "load balancing moves and replicates experts at run time, which this backend does not "
                    "refit yet: serve without enable_eplb")
