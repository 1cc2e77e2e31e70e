"""An engine's life around its refits: vLLM's sleep and wake-up, and bindings that no longer hold.

The backend binds each vLLM parameter's storage once, at ``init_transfer_engine`` (UCX registers that
memory). Before every update the engine checks that the model still uses it: the same parameter, the
same storage, shape, dtype and device. A parameter re-allocated since (``p.data = ...``), or weights
that vLLM's ``sleep(level=2)`` discarded, need a new binding: the engine refuses the update with
:data:`REBIND` in its words, and the trainer sets the transfer up again (binding the memory the model
now uses) and sends a dense update. A parameter whose shape, dtype or device changed is refused by name.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from .. import Error

#: In an engine's refusal: the update needs a new binding (the trainer then sets the transfer up again).
REBIND = "re-bind needed"

Fingerprint = Tuple[int, int, Tuple[int, ...], Any, str]


def fingerprint(t: Any) -> Fingerprint:
    """What a binding holds on to: the storage (its address and identity), shape, dtype and device."""
    return t.data_ptr(), t.untyped_storage()._cdata, tuple(t.shape), t.dtype, str(t.device)


def fingerprints(buffers: Mapping[str, Any]) -> Dict[str, Fingerprint]:
    return {n: fingerprint(t) for n, t in buffers.items()}


def binding_change(model: Any, bound: Mapping[str, Fingerprint]) -> Optional[str]:
    """Why the bound memory is no longer the model's (None when every binding holds): a parameter whose
    layout still holds but whose storage moved (the words carry :data:`REBIND`), or one whose layout
    changed (refused by name)."""
    params = dict(model.named_parameters())
    moved = []
    for name, was in bound.items():
        p = params.get(name)
        if p is None:
            return f"parameter '{name}' is no longer the model's: set the transfer up again"
        now = fingerprint(p.data)
        if now[2:] != was[2:]:
            return (f"parameter '{name}' changed layout since init_transfer_engine (shape, dtype, device "
                    f"{list(was[2])} {was[3]} {was[4]} -> {list(now[2])} {now[3]} {now[4]}): a refit into it "
                    "is refused")
        if now[:2] != was[:2]:
            moved.append(name)
    if moved:
        return (f"{REBIND}: parameter{'s' if len(moved) > 1 else ''} {', '.join(repr(n) for n in moved[:4])}"
                f"{' ...' if len(moved) > 4 else ''} re-allocated since init_transfer_engine (the bound memory is no "
                "longer the model's)")
    return None


class SleepState:
    """The engine's view of vLLM's sleep mode, from the engine's ``sleep`` / ``wake_up`` hooks: ``level``
    (0 awake, 1 weights offloaded, 2 discarded), and after a wake-up whether the bindings still hold
    (``rebind``: why not)."""

    def __init__(self) -> None:
        self.level = 0
        self.rebind: Optional[str] = None

    def bound_anew(self) -> None:
        """A setup bound the memory the model uses now: nothing from before needs a new binding."""
        self.rebind = None

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise Error(f"reshard backend: sleep level {level}: vLLM's levels are 1 and 2")
        self.level = max(self.level, level)

    def wake_up(self, tags: Any, model: Any, bound: Mapping[str, Fingerprint]) -> None:
        """After a wake-up that restores the weights: level 1 kept them where they were (the bindings are
        checked and kept); level 2 discarded them (the next update re-binds and is dense)."""
        if tags is not None and "weights" not in tags:
            return
        if self.level == 2:
            self.rebind = f"{REBIND}: vLLM's sleep(level=2) discarded the weights"
        elif self.level == 1:
            self.rebind = binding_change(model, bound)
        self.level = 0

    def refusal(self) -> Optional[str]:
        if self.level:
            return (f"the engine sleeps (vLLM's sleep(level={self.level})): an update is refused until "
                    "wake_up(tags=['weights']) or wake_up()")
        return None
