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

import datetime
import json
import os
import sys
import threading
import time
from typing import Any, Iterable, Mapping, MutableMapping, Optional, Sequence, Union

from . import _build

if _build.ucx_wheel:  # built against the libucx-cu13 wheel (UCX with CUDA): its libraries first
    import libucx

    libucx.load_library()
from . import _core  # noqa: E402
from ._core import Error, Layout, LayoutError, RefitNotCommitted, TransportError

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

PathLike = Union[str, "os.PathLike[str]"]
#: One rank's buffers: ``{buffer name: tensor}``, or ``{"src": {...}, "dst": {...}}``
#: when a rank has a buffer of the same name on both sides (colocated layouts).
RankBuffers = Mapping[str, Any]


# --- layouts -------------------------------------------------------------------


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


# --- plans ---------------------------------------------------------------------


class Schedule:
    """A planned refit: every copy (ranks, buffers, offsets, extents, strides on both sides).

    ``stats`` is the dict ``reshard-plan --stats`` prints (``bytes``,
    ``local_bytes``, ``copies``, ``max_send_bytes``, ``max_recv_bytes``,
    ``ranks``, ``plan_seconds``); ``to_json()`` is ``reshard-plan --json``.
    """

    __slots__ = ("_s", "_stats")

    def __init__(self, core: "_core.Schedule") -> None:
        self._s = core
        self._stats: Optional[dict] = None

    @property
    def stats(self) -> dict:
        """The schedule's figures, with exactly the keys of ``reshard-plan --stats``."""
        if self._stats is None:
            self._stats = json.loads(self._s.stats_json)
        return dict(self._stats)

    def to_json(self) -> str:
        """The schedule in the contract's format (``reshard.schedule/1``, CONTRACT.md section 2)."""
        return self._s.to_json()

    @property
    def copies(self) -> int:
        """How many copies the schedule holds."""
        return self._s.copies

    @property
    def only_rank(self) -> Optional[int]:
        """The rank this schedule was planned for, or None for a full plan."""
        return self._s.only_rank

    def __len__(self) -> int:
        return self._s.copies

    def __repr__(self) -> str:
        st = self.stats
        who = "" if self.only_rank is None else f" for rank {self.only_rank}"
        return (f"<reshard.Schedule{who} {self._s.src_origin} -> {self._s.dst_origin}: {st['copies']} copies, "
                f"{st['bytes']} B over the network, {st['local_bytes']} B local, {st['ranks']} ranks>")


def plan(src: Layout, dst: Layout, rank: Optional[int] = None, *, cast: bool = False) -> Schedule:
    """Plans the refit from ``src`` to ``dst``; ``rank`` plans only what that global rank sends and receives.
    ``cast=True``: a tensor whose float dtype differs between the sides (f32, bf16, f16) is converted in
    flight (see :class:`Resharder`); else that is an error naming it."""
    return Schedule(_core.plan(src, dst, rank, 0, bool(cast)))


# --- buffers -------------------------------------------------------------------


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


# --- CUDA stream order ---------------------------------------------------------


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


# --- refits --------------------------------------------------------------------


def refit_local(src: Layout, dst: Layout, buffers: Mapping[int, RankBuffers], *, iterations: int = 1,
                timeout: float = 300.0, staging_budget: Optional[int] = None, cast: bool = False,
                stream: Any = None) -> dict:
    """Refits ``src`` -> ``dst`` with every rank of both sides as a thread of this process.

    ``buffers`` maps each global rank to its buffers ``{name: tensor}``
    (``{"src": {...}, "dst": {...}}`` where a rank has a buffer of one name on
    both sides). Source tensors are read, destination tensors written in
    place. The GIL is released while the threads run. ``cast`` as for
    :class:`Resharder`.

    CUDA tensors (where :data:`has_cuda`; ranks as threads sharing the
    process's GPUs, bytes moved by ``cudaMemcpy``): each rank's tensors on one
    GPU, a copy engine for each such rank. The refit starts after the work
    enqueued so far on ``stream`` (default: the current stream of the
    tensors' GPU; tensors on several GPUs: each device is synchronized
    first) and returns after every copy is done.

    Returns a report: ``bytes_moved`` (bytes between different ranks, per
    refit), ``seconds`` (median over ``iterations``, first start to last
    finish), ``local_bytes``, ``messages``, ``plan_seconds``,
    ``iteration_seconds`` and more.
    """
    if not isinstance(buffers, Mapping):
        raise Error("refit_local: buffers must map each global rank to {buffer name: tensor}")
    prepared = {r: _prepare(b) for r, b in buffers.items()}
    devices = _cuda_devices(prepared)
    order = _core.CallerOrder()
    if len(devices) == 1:
        order = _caller_order(next(iter(devices)), stream, None, None, False)
    elif devices:
        if stream is not None:
            raise Error(f"refit_local: tensors on {len(devices)} GPUs ({sorted(devices)}); a stream orders one GPU's work")
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            for d in devices:
                torch.cuda.synchronize(d)
    elif stream is not None:
        raise Error("refit_local: a stream orders CUDA tensors; these are host memory")
    return _core.refit_local(src, dst, prepared, iterations, float(timeout), staging_budget, bool(cast), order)


class _StoreAdapter:
    """What the C++ bootstrap calls: set, poll (non-blocking get) and delete over the caller's store."""

    def __init__(self, store: Any) -> None:
        if not (hasattr(store, "set") and hasattr(store, "get")):
            raise Error(f"Resharder: the store must have set(key, bytes) and get(key) -> bytes; got a {type(store).__name__}")
        self.store = store
        self._check = getattr(store, "check", None)
        self._delete = getattr(store, "delete_key", None)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def poll(self, keys: Sequence[str]) -> "list[Optional[bytes]]":
        keys = list(keys)
        if self._check is not None and self._check(keys):
            # All there: one request for all (TCPStore's multi_get) instead of one per rank.
            multi_get = getattr(self.store, "multi_get", None)
            values = multi_get(keys) if multi_get is not None else [self.store.get(k) for k in keys]
            return [v.encode("latin-1") if isinstance(v, str) else bytes(v) for v in values]
        out: "list[Optional[bytes]]" = []
        for k in keys:
            if self._check is not None:
                v = self.store.get(k) if self._check([k]) else None
            else:
                # A store without check(): get() must raise KeyError (or
                # LookupError) for a missing key; one that blocks instead
                # bounds the wait by its own timeout only.
                try:
                    v = self.store.get(k)
                except LookupError:
                    v = None
            if isinstance(v, str):
                v = v.encode("latin-1")
            out.append(None if v is None else bytes(v))
        return out

    def delete(self, key: str) -> None:
        if self._delete is not None:
            try:
                self._delete(key)
            except Exception:
                pass


def _is_torch_store(store: Any) -> bool:
    """A torch.distributed store (TCPStore, FileStore, PrefixStore ...): it has wait(keys, timedelta)."""
    return any(c.__name__ == "Store" and c.__module__.startswith("torch") for c in type(store).__mro__)


def _listening_socket_inodes(port: int) -> "set[str]":
    """The inodes of the TCP sockets listening on ``port`` on this host (/proc/net/tcp, tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the inode.
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except (OSError, ValueError, StopIteration):
            continue
    return inodes


def _serves_store(store: Any) -> bool:
    """Whether this process hosts the TCPStore that ``store`` talks to (its listening socket is one of this
    process's descriptors). False where that cannot be told (no port, no /proc): then close() cannot keep
    the host until its clients are done, which costs at most c10d's warning in their processes."""
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    port = getattr(store, "port", None)
    if not isinstance(port, int) or port <= 0:
        return False
    inodes = _listening_socket_inodes(port)
    if not inodes:
        return False
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


_generations: "dict[tuple[int, str, int], int]" = {}
_ranks_on_store: "dict[int, set[int]]" = {}  # the ranks of this process that made a Resharder on each store object
_generations_lock = threading.Lock()


class Resharder:
    """One process's endpoint of a multi-process refit (UCX), bootstrapped through a key-value store.

    Every global rank of both layouts creates one, with the same layouts, the
    same store and the same ``prefix``, in the same order as its other
    Resharders on that store (rank R's k-th Resharder on a store object and
    prefix meets the k-th of every other rank: keys ``{prefix}/{k}/...``;
    counted per store object, prefix and rank, so rank threads of one
    process may share one store client). Construction is collective:
    it connects the ranks, plans this rank's part and checks its buffers
    (a bad buffer on any rank makes every rank's constructor raise).

    ``buffers`` are this rank's tensors ``{name: tensor}`` (source buffers
    are read, destination buffers written in place; ``{"src": {...},
    "dst": {...}}`` where a rank has a buffer of one name on both sides).
    They stay bound: change the source tensors' values in place between
    refits, do not replace them.

    ``store``: ``torch.distributed.TCPStore`` or any object with
    ``set(key, bytes)`` and ``get(key) -> bytes`` (with ``check(keys)`` or a
    ``get`` that raises ``KeyError`` on a missing key, the waits keep their
    deadlines). A rank that never arrives or dies makes every other rank
    raise :class:`TransportError` naming it within ``stall_timeout`` plus
    its quarter and a second (about 13.5 s by default), never a hang; a
    refit that did not complete on every rank raises
    :class:`RefitNotCommitted` and never returns a report.

    ``timeout`` bounds one refit (seconds); ``stall_timeout`` is how long a
    wait tolerates no progress; ``protocol`` is ``"tag"`` or ``"put"``;
    ``ucx_config`` sets UCX options over the environment's, e.g.
    ``{"TLS": "tcp,self"}``; ``fast_data_endpoint`` moves data on a second
    endpoint per peer without peer-failure handling, which lets UCX 1.13 use
    CMA zero-copy between processes of one host (about 2-3x faster there) but
    makes a peer that dies mid-copy abort this process instead of raising:
    leave it off unless that trade is wanted (UcxOptions::fast_data_endpoint).

    ``double_buffered=True`` (every rank alike; ranks with destination
    buffers also give ``back_buffers``, a second set of the same names and
    shapes): each refit writes the set not being served and publishes it only
    once the new version is complete on every rank; ``serving_set`` says
    which set inference should read (0: ``buffers``, 1: ``back_buffers``). A
    failed refit leaves the served set untouched.

    ``delta=True`` (every rank alike; host memory): after
    the first refit, each refit sends only the elements whose bits changed
    since what the receiver holds, and leaves every destination bit-identical
    to a dense refit (docs/delta.md). Each sender keeps a shadow of what it
    sent (its sent bytes; ``shadow_budget`` bounds it per destination set,
    pairs past it refit dense). Above ``dense_above`` of the elements changed
    (default 0.06) the refit goes dense. The report's ``delta`` says what
    happened (``mode``: ``prime``, ``delta``, ``dense``, ``sampled`` or
    ``streak``; ``changed_fraction`` over all ranks; ``payload_bytes`` this
    rank sent). The destination must hold what the last refit wrote: a rank
    whose destination something else wrote (inference processing weights
    in place) calls :meth:`invalidate_delta_base` before the next refit.

    ``cast=True`` (every rank alike): a tensor whose float dtype differs
    between the sides (f32, bf16, f16: an f32 master copy or an unwrapped
    model's f32 norms into a bf16 engine) is converted in flight, rounding to
    nearest even as ``Tensor.to()`` does; the sender converts what it sends
    (into a shadow of the destination's dtype, host memory), so the
    destination's dtype crosses the wire. Not with ``delta`` or
    ``double_buffered``. Without it such a tensor is an error naming it.
    """

    def __init__(self, src: Layout, dst: Layout, rank: int, buffers: RankBuffers, transport: str = "ucx",
                 store: Any = None, *, prefix: str = "reshard", timeout: float = 300.0, stall_timeout: float = 10.0,
                 protocol: str = "tag", ucx_config: Optional[Mapping[str, str]] = None,
                 staging_budget: Optional[int] = None, fast_data_endpoint: bool = False,
                 double_buffered: bool = False, back_buffers: Optional[Mapping[str, Any]] = None,
                 delta: bool = False, shadow_budget: Optional[int] = None, dense_above: Optional[float] = None,
                 cast: bool = False) -> None:
        if transport != "ucx":
            raise Error(f"Resharder: transport '{transport}' is not available from Python (use 'ucx'; "
                        "refit_local runs every rank in one process)")
        if not has_ucx:
            raise Error("Resharder: this build of reshard has no UCX transport (install libucx-dev and reinstall)")
        if store is None:
            raise Error("Resharder: a store is needed for the rendezvous (torch.distributed.TCPStore or an object "
                        "with set(key, bytes) and get(key) -> bytes)")
        adapter = _StoreAdapter(store)
        # Counted per (store object, prefix, rank): rank threads of one process may share a store client.
        with _generations_lock:
            key = (id(store), prefix, int(rank))
            g = _generations.get(key, 0)
            _generations[key] = g + 1
            _ranks_on_store.setdefault(id(store), set()).add(int(rank))
        self._store = store
        self._prefix = f"{prefix}/{g}"
        self._stall = float(stall_timeout)
        self._closed = False
        self._r = _core.UcxResharder(src, dst, int(rank), _prepare(buffers), adapter, self._prefix, float(timeout),
                                     float(stall_timeout), protocol, sorted((ucx_config or {}).items()), staging_budget,
                                     bool(fast_data_endpoint), bool(double_buffered),
                                     None if back_buffers is None else _prepare(back_buffers), bool(delta), shadow_budget,
                                     None if dense_above is None else float(dense_above), bool(cast))

    def refit(self, version: Optional[int] = None, *, stream: Any = None, sources_final: Any = None,
              destination_free: Any = None, wait: bool = False) -> dict:
        """Moves the weights (collective: every rank calls it). Returns this rank's report.

        The report holds ``bytes_moved`` (bytes this rank sent), ``seconds``,
        ``version`` (the committed version), ``messages``,
        ``bytes_received``, ``local_bytes``, ``device`` and the plan's
        figures. The GIL is released while data moves.

        CUDA tensors are ordered with ``stream`` (default: the current torch
        stream of their GPU): the refit reads the sources after the work
        enqueued on it so far, or after the event ``sources_final`` (a
        ``torch.cuda.Event`` the trainer recorded after its optimizer step),
        writes the destination after that work, or after
        ``destination_free``, and the stream waits for the refit's last copy,
        so kernels enqueued on it next read the new weights, without the host
        waiting for the copies. ``wait=True``: the host waits too.
        """
        order = _caller_order(self._r.device, stream, sources_final, destination_free, wait)
        return self._r.refit(version, order)

    def close(self) -> None:
        """Waits until every rank closed (collective), then frees the transport. Idempotent.

        With a store that has ``add`` (TCPStore), each rank counts itself in
        and waits until every rank has, then counts itself out; the process
        hosting the store also waits until every rank counted itself out, so
        it can exit as soon as its own ``close()`` returns: no rank still needs it.
        """
        if self._closed:
            return
        self._closed = True
        self._r.close(True)
        add = getattr(self._store, "add", None)
        if add is None:
            return
        key = f"{self._prefix}/closed"
        world = len(self._r.world)
        bound = self._stall * 1.25 + 1
        deadline = time.monotonic() + bound
        n = int(add(key, 1))
        # One rank per store client: wait blocks the client, so ranks sharing one poll instead.
        with _generations_lock:
            alone = len(_ranks_on_store.get(id(self._store), ())) == 1
        wait = self._store.wait if alone and _is_torch_store(self._store) else None
        if wait is not None:
            # The last rank in says so under one key that the others wait for (TCPStore.wait: one
            # request each, answered when it is set) rather than every rank polling the count.
            done = f"{self._prefix}/all_closed"
            if n >= world:
                self._store.set(done, b"1")
            try:
                wait([done], datetime.timedelta(seconds=bound))
            except Exception:
                if time.monotonic() < deadline:
                    return  # the store's host left: it does so only once every rank counted itself out
                try:
                    n = int(add(key, 0))
                except Exception:
                    return  # the store's host left
                raise TransportError(f"rank {self.rank}: close: only {n} of {world} ranks closed within "
                                     f"{bound:.1f} s (a rank died or did not call close())") from None
        else:
            while True:
                try:
                    n = int(add(key, 0))
                except Exception:
                    return  # the store's host left: it does so only once every rank counted itself out
                if n >= world:
                    break
                if time.monotonic() > deadline:
                    raise TransportError(f"rank {self.rank}: close: only {n} of {world} ranks closed within "
                                         f"{bound:.1f} s (a rank died or did not call close())")
                time.sleep(0.005)
        self._leave(add, world, deadline)

    def _leave(self, add: Any, world: int, deadline: float) -> None:
        """Every rank closed. Each counts itself out with one last request; the process hosting the store
        then waits until every rank has, so that it exits only after each client's last request was
        answered (one in flight when the host exits makes c10d print a 'recvValue failed' trace)."""
        key = f"{self._prefix}/left"
        try:
            n = int(add(key, 1))
        except Exception:
            return  # the store's host left early (its own deadline passed)
        if n >= world or not _serves_store(self._store):
            return
        while time.monotonic() < deadline + 1:
            time.sleep(0.002)
            try:
                if int(add(key, 0)) >= world:
                    return
            except Exception:
                return  # this process's own store server is gone: nobody can still be waiting on it
        # Every rank closed, so the refit is complete; a client that did not count itself out
        # died after its close() or is slow to: at worst its process prints c10d's warning.

    def invalidate_delta_base(self) -> None:
        """With ``delta=True``: this rank's destination was written by something else, so the next refit
        of every rank is dense. This rank alone calls it, between refits: the request travels with the
        next refit."""
        self._r.invalidate_delta_base()

    def schedule(self) -> Schedule:
        """This rank's part of the plan."""
        return Schedule(self._r.schedule())

    @property
    def rank(self) -> int:
        return self._r.rank

    @property
    def world(self) -> "list[int]":
        """Every global rank of both layouts (the processes of this refit)."""
        return self._r.world

    @property
    def state(self) -> str:
        """``empty`` (no refit committed), ``current``, ``stale`` (a failed refit wrote part of the destination) or ``closed``."""
        return self._r.state

    @property
    def serving_set(self) -> int:
        """Double-buffered: the destination set to serve (0: ``buffers``, 1: ``back_buffers``); else 0."""
        return self._r.serving_set

    @property
    def last_good_version(self) -> int:
        return self._r.last_good_version

    def __enter__(self) -> "Resharder":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()

    def __repr__(self) -> str:
        return (f"<reshard.Resharder rank {self.rank} of {len(self.world)}: {self._r.src.origin} -> {self._r.dst.origin}, "
                f"state {self.state}, version {self.last_good_version}>")
