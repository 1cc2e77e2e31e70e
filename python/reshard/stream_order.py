"""The caller's CUDA stream order: which stream and events a refit of CUDA tensors waits for and signals."""

from __future__ import annotations

import sys
from typing import Any, Mapping

from . import _core
from .errors import Error


def _stream_handle(stream: Any) -> int:
    # torch.cuda.Stream (its cuda_stream), any object of the CUDA stream protocol, or a raw cudaStream_t.
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        raise Error(f"stream: expected a torch.cuda.Stream, an object with __cuda_stream__ or a cudaStream_t (int); got a "
                    f"{type(stream).__name__}")
    return int(handle)


def _event_handle(event: Any, what: str) -> int:
    if event is None:
        return 0
    if isinstance(event, int):
        return event
    handle = getattr(event, "cuda_event", None)
    if handle is None:
        raise Error(f"{what}: expected a torch.cuda.Event or a cudaEvent_t (int); got a {type(event).__name__}")
    if not handle:
        raise Error(f"{what}: the event was never recorded (record it on the stream whose work it marks)")
    return int(handle)


def _caller_order(device: int, stream: Any, sources_final: Any, destination_free: Any, wait: bool) -> "_core.CallerOrder":
    """The caller's stream order for a rank whose tensors are on cuda:``device`` (-1: host memory)."""
    o = _core.CallerOrder()
    if device < 0:
        if stream is not None or sources_final is not None or destination_free is not None or wait:
            raise Error("stream, sources_final, destination_free and wait order CUDA tensors; this rank's tensors are host memory")
        return o
    if stream is None:
        torch = sys.modules.get("torch")  # CUDA tensors from elsewhere: the legacy default stream
        # Without a device torch cannot say its stream; the C++ side then fails naming the missing device.
        if torch is not None and torch.cuda.is_available():
            stream = torch.cuda.current_stream(device)
    o.stream = 0 if stream is None else _stream_handle(stream)
    o.sources_final = _event_handle(sources_final, "sources_final")
    o.destination_free = _event_handle(destination_free, "destination_free")
    o.wait = bool(wait)
    return o


def _cuda_devices(buffers: Any) -> "set[int]":
    out: set = set()

    def visit(x: Any) -> None:
        if isinstance(x, Mapping):
            for v in x.values():
                visit(v)
            return
        dev = getattr(x, "__dlpack_device__", None)
        if dev is not None:
            kind, index = dev()
            if int(kind) in (2, 13):  # kDLCUDA, kDLCUDAManaged
                out.add(int(index))

    visit(buffers)
    return out
