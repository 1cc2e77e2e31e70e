"""Megatron-Core 0.19 on a CPU, one process per rank (gloo), as ../shared/ENGINES.md measured it: a real
GPTModel (local layer spec) of a HuggingFace config under a Megatron spec such as "tp=2,pp=2" or
"tp=2,dp=2,ep=2,etp=1", wrapped in Megatron's Float16Module (bf16 everywhere, every name prefixed
"module."); Megatron-Bridge 0.6's load_hf_weights as the oracle that fills it from a HuggingFace
checkpoint (``bridge_load``).

Used by the engine tests' workers; needs the Megatron venv (scripts/engine_tests.sh). The caller sets
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE for the trainer's own gloo group.
"""
from __future__ import annotations

import json
import pathlib
import sys
import types

import torch
import torch.nn.functional as F

from reshard.engines.cpu import model_type


def parse_spec(spec: str) -> dict:
    out = {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "etp": None}
    for kv in spec.split(","):
        k, v = kv.split("=")
        out[k.strip()] = int(v)
    return out


def build(cfg: dict, spec: str):
    """This process's rank of a GPTModel for ``cfg`` (a config.json dict) under ``spec``."""
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = parse_spec(spec)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    etp = s["etp"] if s["etp"] is not None else s["tp"]
    mps.initialize_model_parallel(tensor_model_parallel_size=s["tp"], pipeline_model_parallel_size=s["pp"],
                                  context_parallel_size=s["cp"], expert_model_parallel_size=s["ep"],
                                  expert_tensor_parallel_size=etp)
    # The model-parallel RNG states Megatron's initializers fork (a CPU generator stands in for CUDA's).
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
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
        sequence_parallel=False, use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16, **moe)
    if experts:  # per-layer specs: dense and MoE layers as moe_layer_freq says
        layer_spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    else:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm)
    vocab = cfg["vocab_size"]
    padded = -(-vocab // (128 * s["tp"])) * (128 * s["tp"])  # make_vocab_size_divisible_by=128
    model = GPTModel(config=tc, transformer_layer_spec=layer_spec, vocab_size=padded,
                     max_sequence_length=cfg.get("max_position_embeddings", 512),
                     pre_process=mps.is_pipeline_first_stage(), post_process=mps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
                     position_embedding_type="rope")
    return Float16Module(tc, model)


class _Stub(types.ModuleType):
    """transformer_engine stand-in: Bridge imports it at module level (LoRA layers, TE specs); nothing
    that loads a local-spec GPTModel calls it."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            v = type(name, (object,), {"__init__": lambda self, *a, **k: None})
        else:
            v = _Stub(f"{self.__name__}.{name}")
            v.__path__ = []
            sys.modules[v.__name__] = v
        setattr(self, name, v)
        return v


def bridge_load(model, cfg: dict, tensors: dict, work: pathlib.Path):
    """Megatron-Bridge's own HF -> Megatron conversion of ``tensors`` (a checkpoint: HF name -> tensor)
    into this rank's live ``model`` (ENGINES.md: a transformer_engine stub while Bridge is imported,
    Megatron-Core imported first, torch.cuda.current_device answering the CPU)."""
    import megatron.core  # noqa: F401  (its TE version check is cached before the stub exists)
    import safetensors.torch

    for n in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
              "transformer_engine.common.recipe"):
        if n not in sys.modules:
            m = _Stub(n)
            m.__path__ = []
            m.__version__ = "2.8.0"
            sys.modules[n] = m
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.bridge import AutoBridge

    d = work / "hf-checkpoint"
    d.mkdir(parents=True, exist_ok=True)
    c = dict(cfg)
    c["model_type"] = model_type(c)
    (d / "config.json").write_text(json.dumps(c))
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    AutoBridge.from_hf_pretrained(str(d)).load_hf_weights([model])


def load_experts(model, tensors: dict) -> int:
    """Each routed expert's weights of a HF checkpoint (``tensors``: HF name -> tensor) into this rank's live
    MoE ``model``, by Megatron-Core's own expert placement: each MoE layer's ``local_expert_indices``, its
    ``layer_number`` and the expert-tensor-parallel rank. Independent of reshard's Megatron layout, which
    the caller checks against the result. linear_fc1 is [gate_r; up_r] (rows of rank r), linear_fc2 is
    down's columns of rank r. Returns how many local experts were loaded."""
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
