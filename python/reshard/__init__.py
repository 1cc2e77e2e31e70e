"""reshard: refit model weights between parallel layouts from Python.

The package binds the header-only C++ library (``include/reshard``); it does
no planning or data movement of its own. Layouts come from JSON files
(``shared/CONTRACT.md`` section 1) or from the Megatron-Core / vLLM presets;
``plan`` computes which rank sends which strided piece to which rank;
``refit_local`` runs every rank as a thread of this process; ``Resharder`` is
one process's endpoint of a multi-process refit over UCX, bootstrapped
through a key-value store (``torch.distributed.TCPStore`` or any object with
``set(key, bytes)`` and ``get(key) -> bytes``): no ``mpirun``.

Tensors are passed through DLPack (torch, numpy, ...), host memory only in
this build, and are never copied: source tensors are read and destination
tensors written in place. A contiguous tensor of the buffer's dtype and
element count is accepted whatever its shape; a non-contiguous one must have
the buffer's local shape. Every failure is a :class:`reshard.Error` (or a
subclass) carrying the C++ message.

Example (one process, all ranks as threads)::

    import reshard
    src = reshard.read_layout("examples/llama-block/train.json")
    dst = reshard.read_layout("examples/llama-block/infer.json")
    bufs = {r: reshard.allocate(src, r) for r in src.ranks}
    ...  # fill the source tensors
    for r in dst.ranks:
        bufs.setdefault(r, {}).update(reshard.allocate(dst, r))
    report = reshard.refit_local(src, dst, bufs)
"""

from __future__ import annotations

from . import _build

if _build.ucx_wheel:  # built against the libucx-cu13 wheel (UCX with CUDA): its libraries first
    import libucx

    libucx.load_library()
from . import _core  # after libucx: the module links its libraries

# Re-exported: the public API (__all__), and the names the engines and tests import from here.
from .buffers import (
    _NUMPY_DTYPES,
    _TORCH_DTYPES,
    RankBuffers,
    allocate,
    buffer_specs,
    buffers_from_state_dict,
    numpy_dtype,
    torch_dtype,
)
from .errors import Error, LayoutError, RefitNotCommitted, TransportError
from .features import has_cuda, has_ucx, ucx_info
from .layouts import Layout, PathLike, layout_from_json, megatron_layout, model_layouts, read_layout, vllm_layout
from .planning import Schedule, plan
from .refits import Resharder, refit_local
from .store import _serves_store

__all__ = [
    "Error",
    "LayoutError",
    "TransportError",
    "RefitNotCommitted",
    "Layout",
    "Schedule",
    "Resharder",
    "read_layout",
    "layout_from_json",
    "megatron_layout",
    "vllm_layout",
    "model_layouts",
    "plan",
    "refit_local",
    "buffer_specs",
    "allocate",
    "torch_dtype",
    "numpy_dtype",
    "buffers_from_state_dict",
    "has_ucx",
    "has_cuda",
    "ucx_info",
]

__version__ = "0.1.0"
