"""Layouts and memory taken from the live models the engines hold.

* :mod:`reshard.engines.trace`: a rank's layout learnt from memory a loader
  filled with index-tagged checkpoint tensors, and the whole layout from every
  rank's part (engine-neutral).
* :mod:`reshard.engines.vllm`: a live vLLM model's destination layout, traced
  through vLLM's own ``load_weights`` (no table of names), its parameters bound
  in place.
* :func:`bind_parameters`: a live model's ``named_parameters()`` bound to a
  layout's buffers by name, every missing, renamed, reshaped or retyped
  parameter named at setup (Megatron-Core's GPTModel under
  :func:`reshard.megatron_layout`).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Tuple, Union

from .. import Error, Layout, torch_dtype

__all__ = ["bind_parameters", "unwrapped_name"]


def unwrapped_name(name: str, prefix: str = "module.") -> str:
    """A parameter's name without the leading ``prefix`` its wrappers add (Megatron's Float16Module and DDP:
    ``module.``, possibly twice)."""
    while prefix and name.startswith(prefix):
        name = name[len(prefix):]
    return name


def bind_parameters(named: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]], layout: Layout, rank: int, *,
                    strip_prefix: str = "module.", engine: str = "the model") -> "dict[str, Any]":
    """This rank's buffers of ``layout``, taken from a live model's parameters by name.

    ``named`` is ``model.named_parameters()`` (or ``state_dict().items()``, or a
    dict); names lose a leading ``strip_prefix`` (Megatron's Float16Module and
    DDP wrappers add ``module.``, possibly twice). Each buffer the layout
    gives the rank must be a parameter of the same name, element count and
    dtype; the tensors are the parameters' own storage (detached views), so a
    refit writes the live model in place. Raises :class:`reshard.Error`
    naming every missing, reshaped or retyped parameter (and, for a missing
    one, the parameters the model has that the layout does not know, which is
    where a renamed one shows up).
    """
    params = {unwrapped_name(name, strip_prefix): t
              for name, t in (named.items() if isinstance(named, Mapping) else named)}
    out, problems = {}, []
    wanted = layout.buffers(rank)
    known = {b["name"] for b in wanted}
    for b in wanted:
        name = b["name"]
        t = params.get(name)
        if t is None:
            problems.append(f"'{name}' is missing")
            continue
        dtype = torch_dtype(b["dtype"])
        if t.dtype != dtype:
            problems.append(f"'{name}' is {str(t.dtype).replace('torch.', '')} but the layout says {b['dtype']}")
            continue
        if t.numel() != b["elements"]:
            problems.append(f"'{name}' has shape {tuple(t.shape)} ({t.numel()} elements) but the layout's buffer is "
                            f"{tuple(b['shape'])} ({b['elements']} elements)")
            continue
        out[name] = t.detach() if getattr(t, "requires_grad", False) else t
    if problems:
        extra = sorted(set(params) - known)
        hint = ""
        if extra and any("missing" in p for p in problems):
            hint = (f"; {engine} has parameters the layout does not name: {', '.join(extra[:6])}"
                    + (" ..." if len(extra) > 6 else ""))
        raise Error(f"rank {rank}: {engine} does not match {layout.origin}: " + "; ".join(problems[:8])
                    + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else "") + hint)
    return out
