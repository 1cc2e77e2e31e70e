"""Layouts: from JSON files (CONTRACT.md section 1) or the Megatron-Core / vLLM presets."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Union

from . import _core
from ._core import Layout

PathLike = Union[str, "os.PathLike[str]"]


def read_layout(path: PathLike) -> Layout:
    """Reads and validates a layout file (CONTRACT.md section 1).

    Raises :class:`LayoutError` naming the file, tensor and field at fault.
    """
    return _core.read_layout(os.fspath(path))


def layout_from_json(text: Union[str, bytes, Mapping[str, Any]], origin: str = "<json>") -> Layout:
    """A layout from JSON text (or an already parsed dict); ``origin`` names it in messages."""
    if isinstance(text, Mapping):
        text = json.dumps(text)
    if isinstance(text, bytes):
        text = text.decode()
    return _core.layout_from_json(text, origin)


def megatron_layout(config_path: PathLike, spec: str, first_rank: int = 0, *, group_experts: bool = False) -> Layout:
    """The training layout of a HuggingFace ``config.json`` under a Megatron-Core spec.

    ``spec`` is as on the command line, e.g. ``"tp=2,pp=2,dp=2,ep=4"`` (ranks
    ordered pp, dp, cp, tp). ``group_experts`` stacks each MoE layer's experts
    into 3-D tensors (``reshard-plan --group-experts``); both sides must agree.
    """
    return _core.megatron_layout(os.fspath(config_path), spec, first_rank, group_experts)


def vllm_layout(config_path: PathLike, spec: str, first_rank: int = 0, *, group_experts: bool = False) -> Layout:
    """The inference layout of a HuggingFace ``config.json`` under a vLLM spec (``"tp=4,dp=2"``).

    ``first_rank`` is the global rank of its first process: the training
    world size when the two sides are disaggregated, 0 when colocated.
    """
    return _core.vllm_layout(os.fspath(config_path), spec, first_rank, group_experts)


def model_layouts(config_path: PathLike, train: str, infer: str, *, colocate: bool = False,
                  group_experts: bool = False) -> "tuple[Layout, Layout]":
    """Both layouts as ``reshard-plan --model CONFIG --train SPEC --infer SPEC`` builds them.

    The inference side starts at the training world size unless ``colocate``.
    """
    src = megatron_layout(config_path, train, 0, group_experts=group_experts)
    dst = vllm_layout(config_path, infer, 0 if colocate else len(src.ranks), group_experts=group_experts)
    return src, dst
