"""Buffers: what a rank allocates, or picks out of a state dict, and how tensors are handed to the C++ side."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ._core import Layout
from .errors import Error

#: One rank's buffers: ``{buffer name: tensor}``, or ``{"src": {...}, "dst": {...}}``
#: when a rank has a buffer of the same name on both sides (colocated layouts).
RankBuffers = Mapping[str, Any]


def buffer_specs(layout: Layout, rank: int) -> "list[dict]":
    """The buffers ``layout`` gives global rank ``rank``: what to allocate.

    One dict per buffer: ``name``, ``shape`` (the local shape), ``elements``,
    ``dtype`` (contract name: ``bf16``, ``f32`` ...), ``bytes`` and ``tensors``
    (the global tensors whose pieces it holds, in order). Empty when the rank
    is not in the layout.
    """
    return layout.buffers(rank)


_TORCH_DTYPES = {
    "f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16", "fp8e4m3": "float8_e4m3fn",
    "fp8e5m2": "float8_e5m2", "i64": "int64", "i32": "int32", "u32": "uint32", "i8": "int8", "u8": "uint8",
}
_NUMPY_DTYPES = {
    "f64": "float64", "f32": "float32", "f16": "float16", "i64": "int64", "i32": "int32", "u32": "uint32", "i8": "int8",
    "u8": "uint8", "fp8e4m3": "uint8", "fp8e5m2": "uint8",
}


def torch_dtype(dtype: str):
    """The torch dtype of a contract dtype name (``"bf16"`` -> ``torch.bfloat16``)."""
    import torch

    try:
        return getattr(torch, _TORCH_DTYPES[dtype])
    except KeyError:
        raise Error(f"unknown dtype '{dtype}' (expected one of {', '.join(_TORCH_DTYPES)})") from None


def numpy_dtype(dtype: str):
    """The numpy dtype of a contract dtype name; numpy has no bf16 (use torch), FP8 travels as uint8."""
    import numpy

    if dtype not in _NUMPY_DTYPES:
        raise Error(f"dtype '{dtype}' has no numpy equivalent" if dtype in _TORCH_DTYPES else f"unknown dtype '{dtype}'")
    return numpy.dtype(_NUMPY_DTYPES[dtype])


def allocate(layout: Layout, rank: int, framework: str = "torch", *, fill: Optional[float] = 0) -> "dict[str, Any]":
    """Allocates the buffers ``layout`` gives ``rank``, each in its local shape: ``{name: tensor}``.

    ``framework`` is ``"torch"`` or ``"numpy"``; ``fill`` the initial value
    (None: uninitialised).
    """
    out = {}
    for b in layout.buffers(rank):
        if framework == "torch":
            import torch

            t = torch.empty(b["shape"], dtype=torch_dtype(b["dtype"]))
        elif framework == "numpy":
            import numpy

            t = numpy.empty(b["shape"], dtype=numpy_dtype(b["dtype"]))
        else:
            raise Error(f"allocate: framework must be 'torch' or 'numpy', not '{framework}'")
        if fill is not None:
            t[...] = fill
        out[b["name"]] = t
    return out


def buffers_from_state_dict(state_dict: Mapping[str, Any], layout: Layout, rank: int, prefix: str = "") -> "dict[str, Any]":
    """Picks this rank's buffers out of a module's ``state_dict()`` by name (``prefix + buffer name``).

    The presets name buffers as Megatron-Core 0.19's ``GPTModel`` (stage-local
    ``decoder.layers.{i}``, rank-local ``local_experts.{e}``; the norms as
    the non-Transformer-Engine spec names them) and vLLM 0.33 name their
    parameters; docs/python.md ("Bringing your own trainer") lists them
    with their fused forms. A state dict under other names needs a rename
    (or ``prefix``) first; :func:`reshard.engines.bind_parameters` also
    checks each tensor's element count and dtype. Raises
    :class:`Error` naming every buffer the state dict lacks. The tensors are
    the module's own (``state_dict()`` returns detached views of the
    parameters): a refit writes the module's parameters in place.
    """
    out, missing = {}, []
    for b in layout.buffers(rank):
        key = prefix + b["name"]
        if key in state_dict:
            out[b["name"]] = state_dict[key]
        else:
            missing.append(key)
    if missing:
        raise Error(f"rank {rank}: the state dict lacks {len(missing)} buffer(s) of {layout.origin}: {', '.join(missing[:8])}"
                    + (" ..." if len(missing) > 8 else ""))
    return out


def _detach(t: Any) -> Any:
    # torch refuses to export tensors that require grad through DLPack;
    # detach() shares the memory.
    if getattr(t, "requires_grad", False) and hasattr(t, "detach"):
        return t.detach()
    return t


def _prepare(bufs: Any) -> Any:
    if not isinstance(bufs, Mapping):
        return bufs
    if set(bufs.keys()) <= {"src", "dst"} and bufs and all(isinstance(v, Mapping) for v in bufs.values()):
        return {k: {n: _detach(t) for n, t in v.items()} for k, v in bufs.items()}
    return {n: _detach(t) for n, t in bufs.items()}
