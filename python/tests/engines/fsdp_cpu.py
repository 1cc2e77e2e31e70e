"""FSDP2 on a CPU for the engine tests: a HuggingFace model of a config.json, one gloo process per rank,
fully_shard per decoder layer and at the root (as veRL, SkyRL and TRL shard), holding given weights."""
from __future__ import annotations

import torch

#: The HF model_type of each architecture the example configs use (they do not all spell it).
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
               "DeepseekV3ForCausalLM": "deepseek_v3"}


def model_type(cfg: dict) -> str:
    return cfg.get("model_type") or MODEL_TYPES[cfg["architectures"][0]]


def build(cfg: dict, weights: dict):
    """This rank's FSDP2 model (bf16) holding ``weights`` (HF name -> full tensor); gloo initialised here."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("fsdp",))
    hf = transformers.AutoConfig.for_model(model_type(cfg),
                                           **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
