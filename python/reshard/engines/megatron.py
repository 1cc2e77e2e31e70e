"""Megatron-Core 0.19 on a CPU, one gloo process per rank (shared/ENGINES.md): a GPTModel of a HuggingFace
config under a Megatron spec ("tp=2,pp=2", "tp=2,ep=2,etp=1"), as a trainer holds it, and what a trainer
does around a refit that a refit's peer and its checks need.

* :func:`build`: this rank's GPTModel (local layer spec, bf16, inside Megatron's Float16Module, which
  prefixes every name ``module.``), initialised by Megatron's own CPU initialisation when given a seed.
* :func:`train_step`: one forward and backward over the pipeline stages (one micro-batch: activations
  sent stage to stage, their gradients back), gradients averaged over the data-parallel groups.
* :func:`hf_state`: the full HuggingFace checkpoint on global rank 0, as NeMo-RL's and slime's refits
  export it: tensor-parallel shards all-gathered, experts from every expert-parallel rank, stages sent to
  rank 0, fused tensors split into HF's. Written from Megatron's own parameter attributes and conventions,
  not from reshard's Megatron layout, which the RL loop's checks hold against it.
* :func:`load_experts`: each routed expert's weights loaded by Megatron's own expert placement.
* :class:`MegatronSource`: a live GPTModel bound in place to :func:`reshard.megatron_layout`, the trainer's
  source for the vLLM backend (``reshard.vllm``).

The caller sets MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE for the trainer's own gloo group.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import Error, megatron_layout
from . import bind_parameters, unwrapped_name


def parse_spec(spec: str) -> dict:
    """A Megatron spec ("tp=2,pp=2,ep=2,etp=1") as sizes; ``etp`` None when not given (then tp)."""
    out = {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "etp": None}
    for kv in spec.split(","):
        k, _, v = kv.partition("=")
        if k.strip() not in out or not v.strip().isdigit() or int(v) < 1:
            raise Error(f"Megatron spec '{spec}': '{kv}' is not one of {', '.join(k + '=N' for k in out)} (N >= 1)")
        out[k.strip()] = int(v)
    return out


def world_size(spec: str) -> int:
    """The ranks a spec needs: pp x dp x cp x tp (experts share them)."""
    s = parse_spec(spec)
    return s["pp"] * s["dp"] * s["cp"] * s["tp"]


def build(cfg: dict, spec: str, *, seed: Optional[int] = None):
    """This process's rank of a GPTModel for ``cfg`` (a config.json dict) under ``spec``, inside Float16Module.
    With ``seed``, initialised by Megatron's CPU initialisation (each tensor-parallel rank slices the same
    master weights); without, left uninitialised for a loader to fill."""
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = parse_spec(spec)
    if cfg.get("tie_word_embeddings") and s["pp"] > 1:
        raise Error(f"Megatron spec '{spec}': tied word embeddings over pipeline stages are not supported here "
                    "(train_step does not all-reduce the embedding group's gradients)")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_world_size() != world_size(spec):
        raise Error(f"Megatron spec '{spec}' needs {world_size(spec)} ranks, the process group has "
                    f"{dist.get_world_size()}")
    # Megatron's default expert TP is tp; where ep x tp does not fit a stage's ranks (tp=2,ep=2 on 2) it is
    # 1, as reshard.megatron_layout reads the same spec.
    stage = s["tp"] * s["cp"] * s["dp"]
    etp = s["etp"] if s["etp"] is not None else (s["tp"] if stage % (s["ep"] * s["tp"]) == 0 else 1)
    mps.initialize_model_parallel(tensor_model_parallel_size=s["tp"], pipeline_model_parallel_size=s["pp"],
                                  context_parallel_size=s["cp"], expert_model_parallel_size=s["ep"],
                                  expert_tensor_parallel_size=etp)
    # The model-parallel RNG states Megatron's initializers fork (a CPU generator stands in for CUDA's).
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    if not torch.cuda.is_available():
        _on_cpu(tracker)
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    qk_norm = cfg["architectures"][0].startswith("Qwen3")
    moe = {}
    if experts:
        moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                   moe_router_topk=cfg.get("num_experts_per_tok", 2), moe_grouped_gemm=False,
                   moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                   # HF Qwen3-MoE: a layer has experts unless in mlp_only_layers or (layer+1) % step != 0.
                   moe_layer_freq=[0 if (layer in cfg.get("mlp_only_layers", []) or
                                         (layer + 1) % cfg.get("decoder_sparse_step", 1)) else 1
                                   for layer in range(cfg["num_hidden_layers"])])
    tc = TransformerConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=H, num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads", heads), kv_channels=cfg.get("head_dim", H // heads),
        ffn_hidden_size=cfg["intermediate_size"], gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6), add_bias_linear=False,
        qk_layernorm=qk_norm, tensor_model_parallel_size=s["tp"], pipeline_model_parallel_size=s["pp"],
        context_parallel_size=s["cp"], expert_model_parallel_size=s["ep"], expert_tensor_parallel_size=etp,
        sequence_parallel=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        perform_initialization=seed is not None,
        params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16, **moe)
    if experts:  # per-layer specs: dense and MoE layers as moe_layer_freq says
        layer_spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    else:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm)
    vocab = cfg["vocab_size"]
    padded = -(-vocab // (128 * s["tp"])) * (128 * s["tp"])  # make_vocab_size_divisible_by=128
    if seed is not None:
        torch.manual_seed(seed)  # the same on every rank: tensor-parallel ranks slice the same master weights
    model = GPTModel(config=tc, transformer_layer_spec=layer_spec, vocab_size=padded,
                     max_sequence_length=cfg.get("max_position_embeddings", 512),
                     pre_process=mps.is_pipeline_first_stage(), post_process=mps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
                     position_embedding_type="rope")
    return Float16Module(tc, model)


def _on_cpu(tracker) -> None:
    """What a forward on a machine without CUDA needs (shared/ENGINES.md): rotary embeddings and Megatron's
    buffers ask ``torch.cuda.current_device()`` where to live (the CPU here), and the model-parallel RNG fork
    around dropout sets CUDA RNG states (none here; dropout is off)."""
    import contextlib

    torch.cuda.current_device = lambda: torch.device("cpu")
    tracker.fork = lambda *a, **k: contextlib.nullcontext()


def _groups(expert: bool) -> Tuple[Any, Any]:
    """(the tensor-parallel group, the data-parallel group) of a dense or an expert parameter."""
    from megatron.core import parallel_state as mps
    if expert:
        return mps.get_expert_tensor_parallel_group(), mps.get_expert_data_parallel_group()
    return mps.get_tensor_model_parallel_group(), mps.get_data_parallel_group(with_context_parallel=True)


def _is_expert(p: torch.Tensor) -> bool:
    return not getattr(p, "allreduce", True)  # Megatron marks expert parameters allreduce=False


def train_step(model, vocab: int, generator: torch.Generator, *, batch: int = 2, seq: int = 16) -> float:
    """One forward and backward of a toy objective (the mean square of the logits) over the pipeline stages,
    one micro-batch as Megatron's schedule runs it (stage s receives stage s-1's activations, sends its
    own on, then receives their gradient and sends its input's back); then each gradient averaged over its
    data-parallel group, and a replicated parameter's over its tensor-parallel group (they agree already;
    averaging keeps the replicas bit-identical). The forward runs in eval mode (no dropout either way):
    Megatron refuses MoE training under tensor parallelism without sequence parallelism, which torch's
    norms (no TransformerEngine or Apex on this CPU) do not support. ``generator`` draws the batch: seed
    it alike on the ranks of one data-parallel replica. The caller's optimizer steps. Returns the loss
    (on every rank)."""
    from megatron.core import parallel_state as mps

    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    pos = torch.arange(seq).expand(batch, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)  # True where masked (Megatron's convention)
    first, last = mps.is_pipeline_first_stage(), mps.is_pipeline_last_stage()
    model.eval()
    x = None
    if not first:
        x = torch.empty(seq, batch, model.config.hidden_size, dtype=torch.bfloat16)
        dist.recv(x, mps.get_pipeline_model_parallel_prev_rank())
        x.requires_grad_()
        model.set_input_tensor(x)
    out = model(ids, pos, mask)
    value = torch.zeros((), dtype=torch.float32)
    if last:
        tp = mps.get_tensor_model_parallel_world_size()
        loss = out.float().pow(2).sum() / (out.numel() * tp)  # logits are vocab-parallel: the sum over ranks
        loss.backward()
        value = loss.detach().clone()
        dist.all_reduce(value, group=mps.get_tensor_model_parallel_group())
    else:
        dist.send(out.detach().contiguous(), mps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(out)
        dist.recv(grad, mps.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
    if x is not None:
        dist.send(x.grad.contiguous(), mps.get_pipeline_model_parallel_prev_rank())
    dist.all_reduce(value, group=mps.get_pipeline_model_parallel_group())  # the last stage's, everywhere
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                continue
            tp_group, dp_group = _groups(_is_expert(p))
            for g in [dp_group] + ([] if getattr(p, "tensor_model_parallel", False) else [tp_group]):
                n = dist.get_world_size(g)
                if n > 1:
                    dist.all_reduce(p.grad, group=g)
                    p.grad.div_(n)
    return float(value)


def _all_gather(t: torch.Tensor, group) -> List[torch.Tensor]:
    n = dist.get_world_size(group)
    if n == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _mlp_tensors(name: str, shards: List[torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    """An MLP's ``linear_fc1`` / ``linear_fc2`` (tensor-parallel shards in rank order) as HF's projections."""
    if name == "linear_fc1.weight":  # each rank's [gate_r; up_r]
        halves = [s.chunk(2, 0) for s in shards]
        return [("gate_proj.weight", torch.cat([h[0] for h in halves])),
                ("up_proj.weight", torch.cat([h[1] for h in halves]))]
    if name != "linear_fc2.weight":
        raise Error(f"Megatron export: no HuggingFace name for the MLP's '{name}' (linear_fc1, linear_fc2)")
    return [("down_proj.weight", torch.cat(shards, 1))]  # row-parallel


#: Decoder-layer parameters that are one HF tensor each (names within the layer).
LAYER_NAMES = {"input_layernorm.weight": "input_layernorm.weight",
               "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
               "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
               "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
               "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
               "mlp.router.weight": "mlp.gate.weight"}


def _layer_tensors(cfg: dict, name: str, shards: List[torch.Tensor], dim: int) -> List[Tuple[str, torch.Tensor]]:
    """A decoder layer's Megatron parameter (its name within the layer and its tensor-parallel shards, rank
    order, split along ``dim``) as the HuggingFace tensors it holds (names within the layer)."""
    if name == "self_attention.linear_qkv.weight":
        # Rows grouped per query group: the group's query heads, then its key head, then its value head.
        heads = cfg["num_attention_heads"]
        groups = cfg.get("num_key_value_heads", heads)
        d = cfg.get("head_dim", cfg["hidden_size"] // heads)
        full = torch.cat(shards, 0)
        g = full.view(groups, heads // groups + 2, d, full.shape[-1])
        return [("self_attn.q_proj.weight", g[:, :-2].reshape(-1, full.shape[-1])),
                ("self_attn.k_proj.weight", g[:, -2].reshape(-1, full.shape[-1])),
                ("self_attn.v_proj.weight", g[:, -1].reshape(-1, full.shape[-1]))]
    if name.startswith("mlp.linear_fc"):
        return [(f"mlp.{n}", t) for n, t in _mlp_tensors(name[len("mlp."):], shards)]
    if name not in LAYER_NAMES:
        raise Error(f"Megatron export: no HuggingFace name for the decoder layer's '{name}' (supported: "
                    f"{', '.join(sorted(LAYER_NAMES))}, linear_qkv, linear_fc1, linear_fc2, local experts)")
    return [(LAYER_NAMES[name], torch.cat(shards, dim) if len(shards) > 1 else shards[0])]


def _stage_tensors(model, cfg: dict) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's HuggingFace tensors, whole: a collective of every rank of the stage (same order on each)."""
    from megatron.core import parallel_state as mps

    inner = _unwrap(model)
    vocab = cfg["vocab_size"]
    for name, param in inner.named_parameters():
        p = param.detach()  # (Megatron's attributes stay on the parameter)
        tp_group, _ = _groups(_is_expert(param))
        dim = getattr(param, "partition_dim", 0)
        shards = _all_gather(p, tp_group) if getattr(param, "tensor_model_parallel", False) else [p]
        if name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", torch.cat(shards, 0)[:vocab]
        elif name == "output_layer.weight":
            yield "lm_head.weight", torch.cat(shards, 0)[:vocab]
        elif name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", shards[0]
        elif name.startswith("decoder.layers."):
            local, _, rest = name[len("decoder.layers."):].partition(".")
            layer = inner.decoder.layers[int(local)]
            prefix = f"model.layers.{layer.layer_number - 1}"  # layer_number: global, from 1
            if rest.startswith("mlp.experts.local_experts."):
                i, _, within = rest[len("mlp.experts.local_experts."):].partition(".")
                # Each expert-parallel rank's global index of this local expert, by Megatron's placement.
                index = torch.tensor([layer.mlp.local_expert_indices[int(i)]])
                ep = mps.get_expert_model_parallel_group()
                for e, *parts in zip(_all_gather(index, ep), *(_all_gather(s, ep) for s in shards)):
                    for n, t in _mlp_tensors(within, list(parts)):
                        yield f"{prefix}.mlp.experts.{int(e)}.{n}", t
            else:
                for n, t in _layer_tensors(cfg, rest, shards, dim):
                    yield f"{prefix}.{n}", t
        else:
            raise Error(f"Megatron export: no HuggingFace name for '{name}'")


def hf_state(model, cfg: dict) -> Optional[Dict[str, torch.Tensor]]:
    """The full HuggingFace checkpoint of a GPTModel (a collective of every trainer rank): on global rank 0
    a dict of HF name -> tensor, elsewhere None. Each stage's first tensor-parallel rank of data-parallel
    replica 0 sends its stage's tensors to rank 0, which receives them in rank order."""
    from megatron.core import parallel_state as mps

    leader = (mps.get_tensor_model_parallel_rank() == 0 and mps.get_data_parallel_rank(with_context_parallel=True) == 0)
    mine = {}
    for n, t in _stage_tensors(model, cfg):  # every rank runs the gathers; only a leader keeps the results
        if leader:
            mine[n] = t
    meta = [(n, tuple(t.shape), t.dtype) for n, t in mine.items()] if leader else []
    rank = dist.get_rank()
    metas = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(meta, metas, dst=0)
    if rank != 0:
        if leader:
            for t in mine.values():
                dist.send(t.contiguous(), 0)
        return None
    out = dict(mine)
    for src, m in enumerate(metas):
        if src == 0:
            continue
        for n, shape, dtype in m:
            t = torch.empty(shape, dtype=dtype)
            dist.recv(t, src)
            out[n] = t
    return out


def load_experts(model, tensors: dict) -> int:
    """Each routed expert's weights of a HF checkpoint (``tensors``: HF name -> tensor) into this rank's live
    MoE ``model``, by Megatron-Core's own expert placement: each MoE layer's ``local_expert_indices``, its
    ``layer_number`` and the expert-TP rank. Independent of reshard's Megatron layout, which the caller
    checks against the result. linear_fc1 is [gate_r; up_r] (rows of rank r), linear_fc2 is down's columns
    of rank r. Returns how many local experts were loaded."""
    from megatron.core import parallel_state as mps
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    etp, r = mps.get_expert_tensor_parallel_world_size(), mps.get_expert_tensor_parallel_rank()
    loaded = 0
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, TransformerLayer)):
            if not isinstance(layer.mlp, MoELayer):
                continue
            for local, e in zip(layer.mlp.experts.local_experts, layer.mlp.local_expert_indices):
                hf = f"model.layers.{layer.layer_number - 1}.mlp.experts.{e}"
                gate, up, down = (tensors[f"{hf}.{p}_proj.weight"] for p in ("gate", "up", "down"))
                local.linear_fc1.weight.copy_(torch.cat([gate.chunk(etp, 0)[r], up.chunk(etp, 0)[r]]))
                local.linear_fc2.weight.copy_(down.chunk(etp, 1)[r])
                loaded += 1
    return loaded


class MegatronSource:
    """A live Megatron-Core GPTModel as the vLLM backend's trainer source
    (``trainer_init(info, client=..., source=MegatronSource(model, config, spec))``): its layout is
    :func:`reshard.megatron_layout` of the HuggingFace ``config.json`` under the Megatron ``spec``, and
    its parameters are bound in place by their own names (``module.`` prefixes of Float16Module and DDP
    dropped): fused ``linear_qkv`` and ``linear_fc1``, stage-local layers and local experts are sent from
    where they live, with no gather and no copy. Every parameter of the model must be one the layout names
    (else it would never be refit): the constructor refuses the rest, naming them."""

    def __init__(self, model, config: "os.PathLike[str] | str", spec: str):
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != 1:
            raise Error(f"MegatronSource: {len(chunks)} model chunks (virtual pipeline stages) are not supported "
                        "yet: give the one GPTModel of this rank")
        self.model, self.spec = chunks[0], spec
        self.layout = megatron_layout(config, spec)

    def _named(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for n, p in self.model.named_parameters():
            yield unwrapped_name(n), p

    def buffers(self, rank: int) -> Dict[str, torch.Tensor]:
        """This rank's parameters by buffer name: their own storage (detached views)."""
        bound = bind_parameters(self._named(), self.layout, rank, engine=f"the GPTModel ({self.spec})")
        unbound = [n for n, _ in self._named() if n not in bound]
        if unbound:
            raise Error(f"rank {rank}: the GPTModel ({self.spec}) has parameters that reshard.megatron_layout does "
                        f"not give this rank, so no refit would send them: {', '.join(unbound[:6])}"
                        + (" ..." if len(unbound) > 6 else "") + " (another model config or spec?)")
        return bound

    def iter_local(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """This rank's parameters by buffer name (the backend re-binds those whose storage moved)."""
        return self._named()
