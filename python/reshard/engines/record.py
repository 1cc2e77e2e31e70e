"""What a weight loader copies where, recorded as maps between views: no element is touched.

A loader (vLLM's ``load_weights``, a ``weight_loader``) is fed stand-ins of the
checkpoint tensors that have no storage (the meta device), while a
:class:`Recorder` (a ``TorchDispatchMode``) watches every op it runs. Views
(``narrow``, ``chunk``, ``split``, ``view``, ``select``, ``transpose``,
``expand``, ``.data`` ...) need no recording at all: a view shares its base's
storage, and its storage offset, sizes and strides say which elements it
reaches. What is recorded is each *write* into a tracked storage (a
parameter's, or a temporary the loader made), as a map from one view to
another: ``copy_`` (a :class:`Write` from a view of another storage),
``fill_`` and ``zero_`` (a constant). Ops that make new storage out of tracked
storage by moving elements (``clone``, ``contiguous``, ``to``, ``cat``,
``stack``) make a derived storage, itself defined by its writes; any other op
reading a tracked storage makes a *computed* one (its values are no copy of
checkpoint elements), named by the op.

Writes are recorded, never executed: a live model's parameters keep their
values and a meta model needs no memory. The cost is a few microseconds per
op the loader runs, whatever the tensors' sizes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class View:
    """Elements of a storage: ``offset + sum(i_k * strides[k])`` for ``i`` within ``sizes``."""
    offset: int
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]

    @staticmethod
    def of(t: torch.Tensor) -> "View":
        return View(int(t.storage_offset()), tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def coalesced(self) -> "View":
        """The same elements in the same order with size-1 dims dropped and dims that continue each other
        merged (CuTe's coalesce): a contiguous run is ``(offset, (n,), (1,))``."""
        sizes: List[int] = []
        strides: List[int] = []
        for n, s in zip(self.sizes, self.strides):
            if n == 1:
                continue
            if sizes and strides[-1] == n * s:
                sizes[-1] *= n
                strides[-1] = s
            else:
                sizes.append(n)
                strides.append(s)
        return View(self.offset, tuple(sizes), tuple(strides))

    def contiguous_run(self) -> Optional[Tuple[int, int]]:
        """``(start, count)`` when the view is one run of consecutive elements in order, else None."""
        c = self.coalesced()
        if not c.sizes:
            return c.offset, (0 if 0 in self.sizes else 1)
        if len(c.sizes) == 1 and c.strides[0] == 1:
            return c.offset, c.sizes[0]
        if 0 in self.sizes:
            return c.offset, 0
        return None


@dataclasses.dataclass
class Write:
    """``dst`` (a view of the written storage) takes either ``value`` (a constant) or, element for element
    in row-major order of the view's index, the elements of view ``src`` of storage ``source``."""
    dst: View
    source: Optional["Storage"] = None
    src: Optional[View] = None
    value: Optional[float] = None


@dataclasses.dataclass(eq=False)
class Storage:
    """What a tracked storage's elements are.

    * ``checkpoint``: checkpoint tensor number ``index`` (``shape``), row-major.
    * ``target``: made by ``writes`` in order (a parameter, a temporary, a derived copy); unwritten
      elements are nothing (a parameter's padding, or garbage of ``torch.empty``).
    * ``computed``: values no copy expresses; ``why`` names the op.
    """
    kind: str
    name: str
    index: int = -1
    shape: Tuple[int, ...] = ()
    writes: List[Write] = dataclasses.field(default_factory=list)
    why: str = ""
    element_size: int = 0


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (views, ``.data`` and ``detach`` share it)."""
    return t.untyped_storage()._cdata


_FACTORIES = {aten.empty.memory_format: None, aten.empty_strided.default: None, aten.empty_like.default: None,
              aten.new_empty.default: None, aten.new_empty_strided.default: None,
              aten.zeros.default: 0.0, aten.zeros_like.default: 0.0, aten.new_zeros.default: 0.0}
# Ops whose output is the input's elements, moved: out[i] = in[i] in row-major order.
_MOVES = {aten.clone.default, aten._to_copy.default, aten.copy.default, aten.lift_fresh_copy.default,
          aten._unsafe_view.default, aten.alias.default}
_WRITES = {aten.copy_.default, aten.fill_.Scalar, aten.zero_.default}


class Recorder(TorchDispatchMode):
    """Records the writes a loader makes into tracked storages (see the module's docstring).

    ``track_target(t, name)`` registers a parameter; ``checkpoint(k, name, shape, dtype)`` makes the
    stand-in of checkpoint tensor ``k``. After the loader ran, :attr:`targets` maps each parameter name to
    its :class:`Storage` (``writes`` in order).
    """

    def __init__(self) -> None:
        super().__init__()
        self._by_key: Dict[int, Storage] = {}
        self._alive: List[torch.Tensor] = []  # keeps tracked storages from being freed and their keys reused
        self.targets: Dict[str, Storage] = {}
        self.loading: str = ""                # the checkpoint tensor the loader is on (for messages)
        self._written: Dict[Any, Tuple[int, ...]] = {}  # per op: the arguments its schema writes

    def track_target(self, t: torch.Tensor, name: str) -> Storage:
        key = storage_key(t)
        st = self._by_key.get(key)
        if st is not None:
            # Two parameters over one storage (tied embeddings): each its own view of the same writes.
            self.targets[name] = st
            return st
        st = Storage("target", name, element_size=t.element_size())
        self._register(t, st)
        self.targets[name] = st
        return st

    def checkpoint(self, k: int, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        with _disable_current_modes():  # made while the loader runs: not one of its temporaries
            t = torch.empty(tuple(shape), dtype=dtype, device="meta")
        self._register(t, Storage("checkpoint", name, index=k, shape=tuple(int(s) for s in shape),
                                  element_size=t.element_size()))
        return t

    def storage_of(self, t: torch.Tensor) -> Optional[Storage]:
        return self._by_key.get(storage_key(t)) if isinstance(t, torch.Tensor) else None

    def _register(self, t: torch.Tensor, st: Storage) -> None:
        self._by_key[storage_key(t)] = st
        self._alive.append(t)

    # --- the dispatch ------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WRITES:
            dst = args[0]
            st = self.storage_of(dst)
            if st is None and func is aten.copy_.default and self.storage_of(args[1]) is not None:
                # Checkpoint elements copied into a tensor made before the trace (a buffer, not a
                # parameter): tracked from here on, and never written.
                st = Storage("target", "<untracked>", element_size=dst.element_size())
                self._register(dst, st)
            if st is not None:
                self._record_write(func, st, dst, args)
                return dst
        tracked = self._tracked(args, kwargs)
        if tracked:
            mutated = self._mutated_tracked(func, args)
            if mutated is not None:
                # An in-place op the recorder cannot express (index_put_, add_, ...): the storage's values
                # are computed from here on; nothing is executed on it.
                self._poison(mutated, f"the loader changed it with {func.__name__}")
                return args[0]
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            self._new_target(out, func, _FACTORIES[func])
        elif tracked:
            self._derive(func, args, kwargs, out, tracked)
        return out

    def _tracked(self, args, kwargs) -> List[Storage]:
        """The tracked storages among an op's tensor arguments (one level of lists: cat, stack)."""
        by_key = self._by_key
        out: List[Storage] = []
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, torch.Tensor):
                st = by_key.get(a.untyped_storage()._cdata)
                if st is not None:
                    out.append(st)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        st = by_key.get(b.untyped_storage()._cdata)
                        if st is not None:
                            out.append(st)
        return out

    def _mutated_tracked(self, func, args) -> Optional[Storage]:
        written = self._written.get(func)
        if written is None:
            written = self._written[func] = tuple(
                i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        for i in written:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                st = self.storage_of(args[i])
                if st is not None:
                    return st
        return None

    def _record_write(self, func, st: Storage, dst: torch.Tensor, args) -> None:
        if st.kind == "checkpoint":
            raise RuntimeError(f"the loader wrote into checkpoint tensor '{st.name}'")
        if dst.element_size() != st.element_size:
            self._poison(st, f"the loader wrote it through a view of another dtype ({dst.dtype})")
            return
        view = View.of(dst)
        if func is aten.copy_.default:
            src = args[1]
            sst = self.storage_of(src)
            if sst is None:
                st.writes.append(Write(view, Storage("computed", "", why="a tensor that is no checkpoint tensor"),
                                       View.of(src) if isinstance(src, torch.Tensor) else None))
                return
            if src.element_size() != sst.element_size:
                sst = Storage("computed", sst.name, why=f"a view of '{sst.name}' as another dtype ({src.dtype})")
            if tuple(src.shape) != view.sizes:  # a broadcasting copy repeats source elements
                src = src.expand(view.sizes)
            st.writes.append(Write(view, sst, View.of(src)))
        else:
            value = 0.0 if func is aten.zero_.default else float(args[1])
            st.writes.append(Write(view, value=value))

    def _poison(self, st: Storage, why: str) -> None:
        st.writes.append(Write(View(0, (), ()), Storage("computed", st.name, why=why), None))

    def _new_target(self, out, func, value) -> None:
        if not isinstance(out, torch.Tensor):
            return
        st = Storage("target", f"<{func.__name__}>", element_size=out.element_size())
        if value is not None:
            st.writes.append(Write(View.of(out), value=value))
        self._register(out, st)

    def _derive(self, func, args, kwargs, out, tracked: List[Storage]) -> None:
        outs = [out] if isinstance(out, torch.Tensor) else \
            [o for o in out if isinstance(o, torch.Tensor)] if isinstance(out, (list, tuple)) else []
        fresh = [o for o in outs if self.storage_of(o) is None]
        if not fresh:
            return  # a view: it shares a tracked storage
        if func in _MOVES and len(fresh) == 1 and isinstance(args[0], torch.Tensor):
            self._moved(fresh[0], [(fresh[0], args[0])])
        elif func is aten.cat.default:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            parts, at = [], 0
            for t in args[0]:
                if t.dim() == 1 and t.shape[0] == 0:  # cat skips legacy empty tensors
                    continue
                n = t.shape[dim]
                parts.append((fresh[0].narrow(dim, at, n), t))
                at += n
            self._moved(fresh[0], parts)
        elif func is aten.stack.default:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            self._moved(fresh[0], [(fresh[0].select(dim, i), t) for i, t in enumerate(args[0])])
        else:
            why = f"{func.__name__} of '{tracked[0].name}'" if tracked[0].name else func.__name__
            for o in fresh:
                self._register(o, Storage("computed", tracked[0].name, why=why))

    def _moved(self, out: torch.Tensor, parts) -> None:
        st = Storage("target", "<derived>", element_size=out.element_size())
        for dst, src in parts:
            sst = self.storage_of(src)
            if sst is None:
                sst = Storage("computed", "", why="a tensor that is no checkpoint tensor")
            elif src.element_size() != sst.element_size:
                sst = Storage("computed", sst.name, why=f"a view of '{sst.name}' as another dtype ({src.dtype})")
            st.writes.append(Write(View.of(dst), sst, View.of(src.expand(dst.shape))))
        self._register(out, st)


def replay(st: Storage, numel: int) -> Tuple["Any", "Any", Optional[str]]:
    """The element-level picture of a storage made by writes (``numel`` elements): per element the
    checkpoint tensor number (-1: nothing written, -2: a written zero) and the checkpoint element's
    row-major index, or (None, None, why) when a write is computed. Costs the storage's elements: the
    fallback for writes that :mod:`reshard.engines.trace` cannot read as boxes."""
    import numpy as np

    ids = np.full(numel, -1, dtype=np.int64)
    idx = np.zeros(numel, dtype=np.int64)
    why = _replay_into(st, ids, idx)
    return (None, None, why) if why else (ids, idx, None)


def view_indices(v: View):
    """The storage offsets a view reaches, in row-major order of its index (numpy int64)."""
    import numpy as np

    off = np.array([v.offset], dtype=np.int64)
    for n, s in zip(v.sizes, v.strides):
        off = (off[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    return off


def _replay_into(st: Storage, ids, idx) -> Optional[str]:
    for w in st.writes:
        if w.source is not None and w.source.kind == "computed":
            return f"its loader computes values ({w.source.why})"
        d = view_indices(w.dst)
        if w.source is None:
            if w.value != 0.0:
                return f"its loader fills it with {w.value}, no checkpoint element"
            ids[d] = -2
            continue
        s = view_indices(w.src)
        if w.source.kind == "checkpoint":
            ids[d] = w.source.index
            idx[d] = s
            continue
        n = int(s.max()) + 1 if s.size else 0
        sub_ids, sub_idx, why = replay(w.source, n)
        if why:
            return why
        ids[d] = sub_ids[s]
        idx[d] = sub_idx[s]
    return None
