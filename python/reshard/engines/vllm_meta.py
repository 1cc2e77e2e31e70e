"""A whole vLLM engine's layout traced in one process, without weights: :func:`traced_layout`.

For each rank of the engine in turn, vLLM's parallel state is set up for that
rank over fake process groups (torch's ``fake`` backend: collectives that
move nothing, so one process stands for every rank), vLLM's own model class is
built on the meta device (no storage: a 1T-parameter model costs its module
tree), and its ``load_weights`` is traced on storage-less checkpoint stand-ins
(:func:`reshard.engines.vllm.trace_rank`). The ranks' traces are assembled
into one layout and every rank's recorded writes are checked against it, as
:func:`reshard.engines.vllm.live_layout` does across processes. No GPU, no
other process, no weights: a user plans and simulates a production refit on a
laptop.

The checkpoint's tensors (names, shapes, dtypes) are the HuggingFace
checkpoint's as reshard's Megatron preset lists them at tp=1 (the names real
checkpoints carry: experts per expert, MTP layers left out by vLLM's loader).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from .. import Error, Layout
from . import assemble as asm

log = logging.getLogger("reshard")


@dataclasses.dataclass
class TracedLayout:
    """The traced layout of a whole engine, and what the trace left out or read slowly."""
    layout: Layout
    untraced: Dict[str, str]   #: parameter -> why (any rank)
    slow: Dict[str, int]       #: parameters read element by element -> their elements (any rank)
    seconds: float             #: the whole call
    build_seconds: float       #: building the ranks' meta models
    trace_seconds: float       #: running vLLM's loader under the recorder, all ranks

    def to_json(self) -> str:
        return self.layout.to_json()


def parse_spec(spec: str) -> Dict[str, int]:
    """``tp=8,pp=1,dp=1,ep=8`` as vllm_layout reads it (ep > 1: experts over the tp ranks)."""
    out = {"tp": 1, "pp": 1, "dp": 1, "ep": 1}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, val = item.partition("=")
        if key not in out or not val.isdigit() or int(val) < 1:
            raise Error(f"traced_layout: spec '{spec}': '{item}' is not one of tp=N, pp=N, dp=N, ep=N (N >= 1)")
        out[key] = int(val)
    if out["dp"] != 1:
        raise Error(f"traced_layout: spec '{spec}': dp={out['dp']}: each data-parallel replica is its own engine; "
                    f"trace one (dp=1) and place the replicas with first_rank")
    if out["ep"] not in (1, out["tp"]):
        raise Error(f"traced_layout: spec '{spec}': ep={out['ep']} must equal tp={out['tp']} (vLLM's expert "
                    f"parallel group is the tp x dp ranks; dp=1 here)")
    return out


def checkpoint_tensors(config_path) -> List[Tuple[str, Tuple[int, ...], str]]:
    """The HuggingFace checkpoint's tensors of a config: (name, shape, reshard dtype). Reshard's Megatron
    preset at tp=1 lists them as checkpoints carry them (experts one by one); an architecture it does not
    know (Phi-3, GLM-4) takes the names of the transformers model built on the meta device."""
    import reshard

    try:
        ckpt = reshard.megatron_layout(config_path, "tp=1")
    except Error:
        return _transformers_tensors(config_path)
    return [(n, tuple(ckpt.tensor(n)["shape"]), ckpt.tensor(n)["dtype"]) for n in ckpt.tensors]


def _transformers_tensors(config_path) -> List[Tuple[str, Tuple[int, ...], str]]:
    import torch
    import transformers

    from . import cpu
    from .vllm import reshard_dtype

    cfg = json.loads(pathlib.Path(config_path).read_text())
    hf = transformers.AutoConfig.for_model(cpu.model_type(cfg), **{k: v for k, v in cfg.items()
                                                                   if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    return [(n, tuple(t.shape), reshard_dtype(t.dtype)) for n, t in model.state_dict().items()]


@contextlib.contextmanager
def _fake_world(world: int, rank: int):
    """torch.distributed as ``rank`` of ``world`` over fake process groups, in this process; every group
    vLLM makes (gloo for its CPU groups included) is fake too."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    real_new_group = dist.new_group

    def fake_new_group(*args, **kwargs):
        kwargs["backend"] = "fake"
        if len(args) > 2:
            args = args[:2]
        return real_new_group(*args, **kwargs)

    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    dist.new_group = fake_new_group
    # The tp group's shared-memory broadcaster waits for its other ranks' processes: none here. Every
    # rank is this process, on this node (vLLM's own check would exchange over the fake group).
    real_mq = MessageQueue.__dict__["create_from_process_group"]
    MessageQueue.create_from_process_group = staticmethod(lambda *a, **k: None)
    real_same_node = ps.in_the_same_node_as
    ps.in_the_same_node_as = lambda pg, source_rank=0: [True] * dist.get_world_size(pg)
    try:
        yield
    finally:
        ps.in_the_same_node_as = real_same_node
        MessageQueue.create_from_process_group = real_mq
        dist.new_group = real_new_group
        if dist.is_initialized():
            dist.destroy_process_group()


def _engine_config(model_dir: pathlib.Path, sizes: Dict[str, int]):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                      tensor_parallel_size=sizes["tp"], pipeline_parallel_size=sizes["pp"],
                      enable_expert_parallel=sizes["ep"] > 1, distributed_executor_backend="external_launcher",
                      enforce_eager=True, max_model_len=256)
    return args.create_engine_config()


def _rank_model(cfg, sizes: Dict[str, int], rank: int, device: str):
    """vLLM's model of this rank (on the meta device: no storage), its parallel state set up for ``rank``."""
    from vllm.distributed import parallel_state as ps

    from .cpu import vllm_module

    ps.init_distributed_environment(sizes["tp"] * sizes["pp"], rank, "env://", rank, backend="gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"])
    return vllm_module(cfg, device)


def _peak_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def _teardown() -> None:
    from vllm.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def traced_layout(config_path, spec: str, first_rank: int = 0, *, work: Optional[os.PathLike] = None,
                  device: str = "meta", tracer=None, checkpoint=None) -> TracedLayout:
    """The whole layout the targeted vLLM builds for ``config_path`` (a HuggingFace config.json) at
    ``spec`` (vllm_layout's syntax), traced through vLLM's own model classes and loaders in this process
    (CONTRACT.md section 5). Needs vLLM importable; allocates no weights and needs no GPU. ``device`` and
    ``tracer`` are for tests: ``device="cpu"`` builds the ranks' models with storage, which
    ``tracer=reshard.engines.vllm.trace_rank_tags`` (the element-tag reference) needs. ``checkpoint``:
    the checkpoint's ``(name, shape, dtype)`` (default :func:`checkpoint_tensors`)."""
    t0 = time.perf_counter()
    sizes = parse_spec(spec)
    config_path = pathlib.Path(config_path)
    with contextlib.ExitStack() as stack:
        if work is None:
            work = stack.enter_context(tempfile.TemporaryDirectory(prefix="reshard-trace-"))
        return _trace_engine(config_path, spec, sizes, first_rank, pathlib.Path(work), t0, device, tracer,
                             checkpoint)


def _trace_engine(config_path: pathlib.Path, spec: str, sizes: Dict[str, int], first_rank: int,
                  work: pathlib.Path, t0: float, device: str, tracer, checkpoint) -> TracedLayout:
    from . import cpu

    # vLLM inspects each architecture in a subprocess once and caches what it learnt: in a cache that
    # outlives the call (about 10 s saved on every later trace of that architecture).
    env = {"VLLM_CACHE_ROOT": str(pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
                                  / "reshard" / "vllm"), **cpu.vllm_env(work)}
    with _environ(env):  # before vLLM is imported: its platform is chosen then
        return _trace_ranks(config_path, spec, sizes, first_rank, work, t0, device, tracer, checkpoint)


@contextlib.contextmanager
def _environ(env: Dict[str, str]):
    """``env`` where the caller's environment does not say otherwise, for the call only: the caller's
    process (a test runner, a trainer) keeps its own TMPDIR and caches afterwards."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _trace_ranks(config_path: pathlib.Path, spec: str, sizes: Dict[str, int], first_rank: int,
                 work: pathlib.Path, t0: float, device: str, tracer, checkpoint) -> TracedLayout:
    from vllm.config import set_current_vllm_config

    from . import cpu
    from .vllm import trace_rank

    cfg_json = json.loads(config_path.read_text())
    model_dir = cpu.vllm_model_dir(cfg_json, work)
    checkpoint = list(checkpoint) if checkpoint is not None else checkpoint_tensors(config_path)
    cfg = _engine_config(model_dir, sizes)
    log.info("vLLM imported and its engine config made in %.1f s (%d checkpoint tensors)", time.perf_counter() - t0,
             len(checkpoint))
    world = sizes["tp"] * sizes["pp"]
    axes = [("dp", 1), ("pp", sizes["pp"]), ("tp", sizes["tp"])]
    traces, build_s, trace_s = [], 0.0, 0.0
    with set_current_vllm_config(cfg):
        for rank in range(world):
            with _fake_world(world, rank):
                tb = time.perf_counter()
                try:
                    model = _rank_model(cfg, sizes, rank, device)
                    tt = time.perf_counter()
                    coords = {"dp": 0, "pp": rank // sizes["tp"], "tp": rank % sizes["tp"]}
                    traces.append((tracer or trace_rank)(model, checkpoint, coords))
                finally:
                    _teardown()
                build_s += tt - tb
                trace_s += time.perf_counter() - tt
                del model
            log.info("traced rank %d of %d (%s) in %.2f s (peak memory so far %.2f GB)", rank, world, spec,
                     time.perf_counter() - tb, _peak_gb())
    origin = f"vllm traced layout ({config_path.name}, {spec})"
    shapes = {n: list(s) for n, s, _ in checkpoint}
    ta = time.perf_counter()
    _, layout = asm.assemble(traces, axes, shapes, first_rank=first_rank, origin=origin)
    tv = time.perf_counter()
    why = asm.verify_traces(layout, traces, checkpoint, first_rank)
    if why:
        raise Error(why)
    log.info("assembled in %.1f s, checked against every rank's recorded writes in %.1f s", tv - ta,
             time.perf_counter() - tv)
    untraced: Dict[str, str] = {}
    slow: Dict[str, int] = {}
    for t in traces:
        untraced.update(t.untraced)
        slow.update(t.slow)
    seconds = time.perf_counter() - t0
    log.info("traced layout of %s at %s: %.1f s (building %.1f s, tracing %.1f s), %d untraced", config_path.name,
             spec, seconds, build_s, trace_s, len(untraced))
    return TracedLayout(layout, untraced, slow, seconds, build_s, trace_s)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m reshard.engines.vllm trace CONFIG --infer SPEC [-o FILE] [--first-rank N]``."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m reshard.engines.vllm",
                                 description="Trace a vLLM engine's layout through vLLM's own loaders, "
                                             "without weights or GPUs, and write it as layout JSON.")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="the layout of CONFIG served at --infer SPEC")
    t.add_argument("config", help="a HuggingFace config.json")
    t.add_argument("--infer", required=True, help="vllm_layout's spec, e.g. tp=8 or tp=16,ep=16")
    t.add_argument("--first-rank", type=int, default=0, help="the engine's first global rank (default 0)")
    t.add_argument("-o", "--output", help="write the layout here (default: stdout)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        traced = traced_layout(a.config, a.infer, a.first_rank)
    except Error as e:
        print(f"reshard: {e}", file=sys.stderr)
        return 1
    text = traced.to_json()
    if a.output:
        pathlib.Path(a.output).write_text(text)
    else:
        sys.stdout.write(text + "\n")
    for name, why in sorted(traced.untraced.items()):
        print(f"untraced: {name}: {why}", file=sys.stderr)
    print(f"traced in {traced.seconds:.1f} s ({len(traced.untraced)} parameters untraced)", file=sys.stderr)
    return 0
