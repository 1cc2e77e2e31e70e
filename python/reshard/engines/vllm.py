"""A live vLLM model as a refit destination: its layout traced through vLLM's own loader.

On every rank of a vLLM engine (one process per tensor- and pipeline-parallel
rank), :func:`live_layout` runs the model's own ``load_weights`` once on
index-tagged stand-ins of the checkpoint tensors (the parameters swapped for
float64 arrays meanwhile, then put back untouched), so each parameter says
which slice of which checkpoint tensor vLLM puts where: fused ``qkv_proj`` and
``gate_up_proj``, MoE ``w13`` / ``w2`` under whatever name this vLLM release
gives them, padded vocabularies, replicated kv heads, expert placement. No
table of names is involved. The ranks then exchange their parts and every
rank builds the same layout (CONTRACT.md section 1; ``to_json()`` writes it),
checks slot by slot that it reproduces what vLLM's loader did on that rank,
and binds each parameter's own storage as its buffer.

A parameter whose loader computes rather than copies (a transform, a scale)
is not in the layout: :attr:`LiveLayout.untraced` names it with the reason and
:attr:`LiveLayout.untraced_bytes` counts it, so a caller loads it another way
(vLLM's ``load_weights`` of those tensors) and reports both paths.

Needs vLLM (tested with 0.33.0) and its distributed state initialised.
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import re
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .. import _TORCH_DTYPES, Error, Layout
from . import assemble as asm
from . import trace as tr

log = logging.getLogger("reshard")

#: The vLLM release whose loaders the tests run this against.
TESTED_VLLM = "0.33.0"

def reshard_dtype(dtype: Any) -> str:
    """reshard's name of a torch dtype."""
    try:
        return {f"torch.{t}": name for name, t in _TORCH_DTYPES.items()}[str(dtype)]
    except KeyError:
        raise Error(f"dtype {dtype} has no reshard equivalent") from None


@dataclasses.dataclass
class LiveLayout:
    """A rank's view of the traced layout of a live model."""
    layout: Layout                 #: the whole layout, the same on every rank
    buffers: Dict[str, Any]        #: this rank's parameters in the layout, by name (their own storage)
    untraced: Dict[str, str]       #: parameters left out (any rank), with why
    untraced_bytes: int            #: this rank's bytes of those
    traced_bytes: int              #: this rank's bytes bound in place (padding included)
    real_bytes: int                #: of those, the checkpoint elements' (what a refit writes here)
    rank: int                      #: this rank's global rank in the layout
    seconds: float = 0.0           #: the trace, exchange, assembly and check
    #: the model's parameters whose storage the buffers are (by parameter name; the buffers themselves where
    #: None): a buffer may be a view of one (a scale tensor's rows of a fused scale parameter)
    parameters: Optional[Dict[str, Any]] = None
    #: redoes, in place, what the engine's post-processing derives from refit parameters (None: nothing)
    post_processing: Optional[Callable[[], None]] = None

    def bound_parameters(self) -> Dict[str, Any]:
        return self.buffers if self.parameters is None else self.parameters

    def refresh(self) -> None:
        """After a refit: every parameter the engine derives from refit ones brought up to date, in place
        (MLA's W_UK_T / W_UV of an FP8 kv_b_proj); nothing where the engine derives nothing."""
        if self.post_processing is not None:
            self.post_processing()

    def to_json(self) -> str:
        return self.layout.to_json()


def _checkpoint_entries(checkpoint) -> "Tuple[List[str], List[List[int]], List[Any]]":
    import torch

    names, shapes, dtypes = [], [], []
    for entry in checkpoint:
        names.append(entry[0])
        shapes.append([int(x) for x in entry[1]])
        dt = entry[2] if len(entry) > 2 else torch.bfloat16
        dtypes.append(getattr(torch, _TORCH_DTYPES[dt]) if isinstance(dt, str) else dt)
    if len(set(names)) != len(names):
        raise Error("trace: a checkpoint tensor name is given twice")
    return names, shapes, dtypes


def trace_rank(model: Any, checkpoint: Sequence[Tuple[str, Sequence[int]]], coords: Mapping[str, int],
               load: Optional[Callable[[Iterable[Tuple[str, Any]]], Any]] = None) -> tr.RankTrace:
    """This rank's trace: ``load`` (default ``model.load_weights``) fed storage-less stand-ins of
    ``checkpoint`` (``(name, shape)`` or ``(name, shape, dtype)``, in any order; bf16 by default) while
    :class:`reshard.engines.record.Recorder` records what it copies where. Nothing is written: the
    parameters keep their values (a live model) or stay without storage (a meta model)."""
    import torch

    from . import record as rec

    names, shapes, dtypes = _checkpoint_entries(checkpoint)
    views = views_of_other_parameters(model)
    params = [(n, p) for n, p in model.named_parameters() if n not in views]
    saved = [p.data for _, p in params]
    load = load or model.load_weights
    recorder = rec.Recorder()
    targets = {n: recorder.track_target(p.data, n) for n, p in params}

    remote = remote_expert(model)

    def stand_ins():
        for k, (n, s, dt) in enumerate(zip(names, shapes, dtypes)):
            if remote(n):
                continue
            recorder.loading = n
            yield n, recorder.checkpoint(k, n, s, dt)
    try:
        with torch.no_grad(), recorder:
            load(stand_ins())
    except Exception as e:  # the engine's own loader refused the checkpoint's names or shapes
        raise Error(f"trace: the model's load_weights failed on the checkpoint's stand-ins (at "
                    f"'{recorder.loading}'): {type(e).__name__}: {e}") from e
    finally:
        replaced = [n for (n, p), d in zip(params, saved) if p.data is not d and rec.storage_key(p.data) != rec.storage_key(d)]
        for (_, p), d in zip(params, saved):
            p.data = d
    traced, untraced, ubytes, slow = [], {}, {}, {}
    for (n, p), d in zip(params, saved):
        if n in replaced:
            pt, why, elementwise = None, "its loader replaced the parameter's storage (p.data = ...)", False
        else:
            pt, why, elementwise = tr.read_writes(n, targets[n], d.numel(), reshard_dtype(d.dtype), names, shapes)
        if elementwise:
            slow[n] = d.numel()
        if pt is None:
            untraced[n] = why
            ubytes[n] = d.numel() * d.element_size()
        else:
            traced.append(pt)
    return tr.RankTrace(dict(coords), traced, untraced, ubytes, slow)


def views_of_other_parameters(model: Any) -> Dict[str, str]:
    """Parameters that are views into part of another parameter's storage (name -> that parameter), such as
    MLA's ``W_UK_T`` / ``W_UV`` of a BF16 ``kv_b_proj`` after vLLM's post-processing: they follow their
    owner, so the trace leaves them out (a refit writes the owner). Parameters sharing a whole storage (tied
    embeddings) are no views."""
    from . import record as rec

    by_storage: Dict[int, List[Tuple[str, Any]]] = {}
    for n, p in model.named_parameters():
        by_storage.setdefault(rec.storage_key(p.data), []).append((n, p.data))
    out: Dict[str, str] = {}
    for group in by_storage.values():
        whole = [n for n, t in group if t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()]
        if len(group) > 1 and whole:
            out.update({n: whole[0] for n, _ in group if n not in whole})
    return out


_EXPERT = re.compile(r"^(.*)\.(\d+)\.[^.]+(?:\.[^.]+)*$")


def remote_expert(model: Any) -> Callable[[str], bool]:
    """Whether a checkpoint tensor belongs to an expert that vLLM's own expert map places on no slot of
    this rank (``PREFIX.E.*`` under a MoE layer whose ``layer_name`` is PREFIX): its loader would skip it,
    so the trace does not feed it (an expert-parallel rank then costs its own experts' tensors, not all).
    The maps are read once, before the trace."""
    local: Dict[str, Optional[set]] = {}
    for _, m in model.named_modules():
        manager = getattr(m, "expert_map_manager", None)
        prefix = getattr(m, "layer_name", None)
        if manager is None or not isinstance(prefix, str):
            continue
        emap = getattr(manager, "expert_map", None)
        local[prefix] = None if emap is None else {int(e) for e in (emap != -1).nonzero().flatten().tolist()}
    if not local:
        return lambda name: False

    def remote(name: str) -> bool:
        m = _EXPERT.match(name)
        while m is not None:
            prefix = m.group(1)
            if prefix in local:
                mine = local[prefix]
                return mine is not None and int(m.group(2)) not in mine
            m = _EXPERT.match(prefix)
        return False
    return remote


def trace_rank_tags(model: Any, checkpoint: Sequence[Tuple[str, Sequence[int]]], coords: Mapping[str, int],
                    load: Optional[Callable[[Iterable[Tuple[str, Any]]], Any]] = None) -> tr.RankTrace:
    """The element-tag trace (the reference :func:`trace_rank` is tested against): every checkpoint
    element fed as a float64 tag and every parameter swapped for a float64 array while ``load`` runs.
    Costs 8 bytes of memory per checkpoint element and per parameter element, and their time."""
    import torch

    names, shapes, _ = _checkpoint_entries(checkpoint)
    views = views_of_other_parameters(model)
    params = [(n, p) for n, p in model.named_parameters() if n not in views]
    saved = [p.data for _, p in params]
    load = load or model.load_weights
    slots: Dict[str, Any] = {}
    try:
        for _, p in params:
            p.data = torch.full(p.data.shape, -1.0, dtype=torch.float64)
        try:
            with torch.no_grad():
                load((n, tr.tag_tensor(k, s)) for k, (n, s) in enumerate(zip(names, shapes)))
        except Exception as e:
            raise Error(f"trace: the model's load_weights failed on the tagged checkpoint: "
                        f"{type(e).__name__}: {e}") from e
        for n, p in params:
            slots[n] = p.data.numpy().reshape(-1)
    finally:
        for (_, p), d in zip(params, saved):
            p.data = d
    traced, untraced, ubytes = [], {}, {}
    for (n, p), d in zip(params, saved):
        pt, why = tr.read_parameter(n, slots[n], reshard_dtype(d.dtype), names, shapes)
        if pt is None:
            untraced[n] = why
            ubytes[n] = d.numel() * d.element_size()
        else:
            traced.append(pt)
    return tr.RankTrace(dict(coords), traced, untraced, ubytes)


def _vllm_mesh() -> "Tuple[List[Tuple[str, int]], Dict[str, int], Any]":
    from vllm.distributed import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pp_group().world_size
    dp = ps.get_dp_group().world_size if hasattr(ps, "get_dp_group") else 1
    if dp != 1:
        raise Error(f"vLLM with data parallel size {dp}: each replica is its own engine; trace each one "
                    f"(a mesh with dp is not built from one engine's ranks yet)")
    coords = {"pp": ps.get_pp_group().rank_in_group, "tp": ps.get_tensor_model_parallel_rank()}
    return [("pp", pp), ("tp", tp)], coords, ps.get_world_group().cpu_group


def _gather_torch(group: Any) -> Callable[[Any], List[Any]]:
    import torch.distributed as dist

    def gather(obj: Any) -> List[Any]:
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return gather


def live_layout(model: Any, checkpoint: Sequence[Tuple[str, Sequence[int]]], *, first_rank: int = 0,
                gather: Optional[Callable[[Any], List[Any]]] = None, load: Optional[Callable] = None,
                axes: Optional[Sequence[Tuple[str, int]]] = None, coords: Optional[Mapping[str, int]] = None,
                origin: Optional[str] = None, tracer: Optional[Callable] = None) -> LiveLayout:
    """The destination layout of a live vLLM model, traced on this rank and exchanged with the others.

    Call it on every rank of the engine, after the model is built (weights
    loaded or not; they are left as they are). ``checkpoint``: the checkpoint
    tensors' ``(name, shape)`` or ``(name, shape, dtype)`` (e.g. a source
    layout's tensors, or a safetensors index). ``first_rank``: this engine's
    first global rank in the refit (the trainer's world size when
    disaggregated). ``gather`` exchanges a picklable object among the engine's
    ranks (default: vLLM's world group over torch.distributed); ``axes`` /
    ``coords`` default to vLLM's parallel state (pp, tp). ``tracer``: the
    rank's trace (default :func:`trace_rank`; :func:`trace_rank_tags` is the
    element-tag reference). Raises :class:`reshard.Error` on every rank when
    any rank's trace or check fails, naming that rank.
    """
    t0 = time.perf_counter()
    if axes is None or coords is None:
        vaxes, vcoords, group = _vllm_mesh()
        axes = axes or vaxes
        coords = coords or vcoords
        gather = gather or _gather_torch(group)
    if gather is None:
        raise Error("live_layout: give gather= with axes= and coords=")
    rank = first_rank + asm.position(axes, coords)
    try:
        mine = (tracer or trace_rank)(model, checkpoint, coords, load)
        part: Any = pickle.dumps(mine)
    except Error as e:  # every rank learns it at the exchange, none waits for a part that never comes
        part = f"rank {rank}: {e}"
    t_trace = time.perf_counter()
    parts = gather(part)
    failed = [p for p in parts if isinstance(p, str)]
    if failed:
        raise Error(failed[0] if len(failed) == 1 else f"{failed[0]} (and {len(failed) - 1} more ranks failed)")
    traces = [pickle.loads(b) for b in parts]
    origin = origin or f"vllm live layout ({', '.join(f'{a}={s}' for a, s in axes)})"
    layout, err = _assemble_and_verify(traces, mine, axes, checkpoint, first_rank, rank, origin)
    verdicts = gather(err)
    bad = [v for v in verdicts if v]
    if bad:
        raise Error(bad[0] if len(bad) == 1 else f"{bad[0]} (and {len(bad) - 1} more ranks failed)")
    live = _bind(model, layout, traces, rank)
    live.seconds = time.perf_counter() - t0
    log.info("live layout of rank %d: traced in %.2f s, assembled and checked in %.2f s (%d parameters, %d "
             "read element by element, %d untraced)", rank, t_trace - t0, live.seconds - (t_trace - t0),
             len(mine.params), len(mine.slow), len(mine.untraced))
    return live


def _assemble_and_verify(traces, mine: tr.RankTrace, axes, checkpoint, first_rank: int, rank: int,
                         origin: str) -> "Tuple[Optional[Layout], Optional[str]]":
    """The whole layout from every rank's trace, checked against this rank's recorded writes."""
    shapes = {e[0]: list(e[1]) for e in checkpoint}
    try:
        _, layout = asm.assemble(traces, axes, shapes, first_rank=first_rank, origin=origin)
        return layout, asm.verify_traces(layout, traces, checkpoint, first_rank, checked=[mine])
    except Error as e:
        return None, f"rank {rank}: {e}"


def _bind(model: Any, layout: Layout, traces, rank: int) -> LiveLayout:
    """This rank's parameters bound as the layout's buffers, and what the trace left out."""
    untraced: Dict[str, str] = {}
    for t in traces:
        untraced.update(t.untraced)
    params = dict(model.named_parameters())
    bufs = {}
    for b in layout.buffers(rank):
        p = params.get(b["name"])
        if p is None:
            raise Error(f"rank {rank}: the layout names buffer '{b['name']}' that the model has no parameter of")
        bufs[b["name"]] = p.data
    ubytes = sum(p.data.numel() * p.data.element_size() for n, p in params.items() if n in untraced)
    tbytes = sum(t.numel() * t.element_size() for t in bufs.values())
    real = 0
    for b, runs in layout.slot_runs(rank, columns=True).items():
        real += int(runs[runs[:, 2] >= 0, 1].sum()) * bufs[b].element_size()
    return LiveLayout(layout, bufs, untraced, ubytes, tbytes, real, rank)


def traced_layout(config_path: Any, spec: str, first_rank: int = 0, **kwargs: Any):
    """The whole engine's layout for a config and parallel spec, traced in this process without weights
    (CONTRACT.md section 5): :func:`reshard.engines.vllm_meta.traced_layout`."""
    from .vllm_meta import traced_layout as traced

    return traced(config_path, spec, first_rank, **kwargs)


if __name__ == "__main__":
    import sys

    from .vllm_meta import main

    sys.exit(main())
