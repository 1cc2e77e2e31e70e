"""What this build of the module can do: the UCX transport, CUDA tensors."""

from __future__ import annotations

from . import _core
from .errors import Error

#: Whether this build has the UCX transport (``Resharder(transport="ucx")``).
has_ucx: bool = bool(_core.has_ucx)


def ucx_info() -> dict:
    """The UCX this process loaded and what memory it moves, asked of UCX itself
    (``{"version": "1.22.0", "cuda": False, "summary": ...}``): CUDA tensors
    cross processes only where ``cuda`` is True (a UCX built with CUDA, such as
    the libucx-cu13 wheel's, on a machine with a CUDA driver: docs/python.md).
    """
    if not has_ucx:
        raise Error("ucx_info: this build of reshard has no UCX transport")
    return dict(_core.ucx_info())

#: Whether this build takes CUDA tensors (built where nvcc was found: the CUDA
#: copy engine is in the module). Without it CUDA tensors are refused by name.
has_cuda: bool = bool(_core.has_cuda)
