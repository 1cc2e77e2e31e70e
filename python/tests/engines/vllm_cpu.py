"""vLLM 0.33 on a CPU, one process per rank, as ../shared/ENGINES.md measured it: the real model class
built by vLLM's own loader (no weights), sharded by vLLM's own ``load_weights``.

Used by the engine tests' workers; needs the vLLM venv (scripts/engine_tests.sh). The caller sets
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK for vLLM's own gloo group, and points
vLLM's caches and temp files into the test's folder (``cpu_env``).
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Dict, Iterable, Tuple

import torch

import fsdp_cpu


def cpu_env(work: pathlib.Path) -> Dict[str, str]:
    """The environment a vLLM CPU process of a test needs: everything it writes stays under ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    return {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "XDG_CACHE_HOME": str(work / "cache"),
            "HF_HOME": str(work / "hf"), "TMPDIR": str(work), "VLLM_RPC_BASE_PATH": str(work),
            "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "VLLM_LOGGING_LEVEL": "WARNING",
            "VLLM_HOST_IP": "127.0.0.1"}


def model_dir(config: dict, work: pathlib.Path) -> pathlib.Path:
    """A folder vLLM reads as a model: its config.json only (load_format="dummy", no tokenizer)."""
    d = work / "model"
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    cfg["model_type"] = fsdp_cpu.model_type(cfg)
    cfg.setdefault("max_position_embeddings", 512)
    if cfg["architectures"][0] == "DeepseekV3ForCausalLM":
        cfg.setdefault("topk_method", "noaux_tc")  # HF's default: the router has e_score_correction_bias
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def build(model_path: pathlib.Path, tp: int, *, expert_parallel: bool = False):
    """This process's rank of a vLLM engine: the bare module (no weights loaded) and its config."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    args = EngineArgs(model=str(model_path), skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                      tensor_parallel_size=tp, enable_expert_parallel=expert_parallel,
                      distributed_executor_backend="external_launcher", enforce_eager=True, max_model_len=256)
    cfg = args.create_engine_config()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ctx = set_current_vllm_config(cfg)
    ctx.__enter__()  # kept for the life of the process: loaders read the current config
    init_distributed_environment(world, rank, "env://", int(os.environ.get("LOCAL_RANK", rank)), backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=tp)
    with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        model = get_model_loader(cfg.load_config).create_model(vllm_config=cfg, model_config=cfg.model_config)
    return model, cfg


def load(model, tensors: Iterable[Tuple[str, torch.Tensor]]):
    """vLLM's own loader: the reference every refit is compared with."""
    with torch.no_grad():
        return model.load_weights(iter(tensors))
