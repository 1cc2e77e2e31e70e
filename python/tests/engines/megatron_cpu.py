"""Megatron-Bridge 0.6's load_hf_weights as the oracle that fills a live GPTModel
(reshard.engines.megatron.build) from a HuggingFace checkpoint (``bridge_load``), on a CPU as
../shared/ENGINES.md measured it.

Used by the engine tests' workers; needs the engines venv (scripts/engine_tests.sh).
"""
from __future__ import annotations

import json
import pathlib
import sys
import types

import torch

from reshard.engines.cpu import model_type


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
