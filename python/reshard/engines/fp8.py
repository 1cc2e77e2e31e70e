"""Block-FP8 engines as refit destinations: BF16 trainer tensors quantized in flight into vLLM's FP8
parameters (CONTRACT.md section 1, the ``block`` scheme; docs/fp8.md).

A vLLM engine serving a DeepSeek-V3-style block-FP8 model (``quantization_config``: ``quant_method``
``fp8``, ``weight_block_size`` [128, 128]) holds each quantized projection as an e4m3 ``weight`` and an f32
``weight_scale_inv`` of one entry per tile, both fused per projection as its loader fuses them
(``qkv_proj.weight_scale_inv`` = the q, k and v scales' rows of this rank, one after the other).

:func:`quantized_live_layout` makes such an engine's destination layout from vLLM's own loader only:

1. which checkpoint tensors the engine quantizes: those its ``load_weights`` copies into an FP8 parameter
   (a trace of the BF16 checkpoint, gathered over the engine's ranks: an expert-parallel rank sees only
   its own experts);
2. the layout of the FP8 checkpoint (each quantized tensor in e4m3 and its ``weight_scale_inv``), traced
   and checked as any checkpoint (:func:`reshard.engines.vllm.live_layout`);
3. each quantized tensor marked ``quant`` with its scale tensor. The core takes a scale tensor stored alone
   only, while vLLM's are rows of a fused parameter: on every rank each part of a dim-0 concat is a
   contiguous range of the fused parameter, so each scale tensor is bound to its own range, a view, no copy.

The refit then quantizes on the senders where their pieces are whole tiles (FP8 bytes and scales cross the
wire) and on the receivers otherwise. :func:`reference_checkpoint` is the reference the tests and the
peer path use: the FP8 checkpoint of a BF16 state dict, quantized with torch ops as the contract states,
written independently of the core's quantizer.

On a CPU without AMX, vLLM 0.33 refuses to build a block-FP8 model (no kernel for its GEMM);
:func:`allow_block_fp8_on_cpu` lets it build (no GEMM ever runs: tests and dry runs only).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from .. import Error, layout_from_json

log = logging.getLogger("reshard")

E4M3_MAX = 448.0
#: DeepSeek-V3's quantization_config (its config.json), the block-FP8 format the engines serve.
DEEPSEEK_V3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}
#: The tensors an FP8 checkpoint of DeepSeek-V3's kind holds in e4m3: every projection of the decoder
#: layers (attention, MLP, experts, shared experts); embeddings, norms, routers and lm_head stay BF16.
_CHECKPOINT_FP8 = re.compile(r"(^|\.)layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def block_of(hf_config: Any) -> Optional[Tuple[int, ...]]:
    """The weight block of a block-FP8 model's ``quantization_config`` (None: not FP8). Other FP8 schemes
    (per-tensor, per-channel) are refused, naming them."""
    q = getattr(hf_config, "quantization_config", None) if not isinstance(hf_config, Mapping) else \
        hf_config.get("quantization_config")
    if not q:
        return None
    q = q if isinstance(q, Mapping) else vars(q)
    if q.get("quant_method") != "fp8":
        raise Error(f"reshard: quantization '{q.get('quant_method')}' is not supported (block FP8 only)")
    block = q.get("weight_block_size")
    if not block:
        raise Error("reshard: FP8 without weight_block_size (per-tensor scales) is not supported (block FP8 only)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise Error(f"reshard: FP8 format '{q.get('fmt')}' is not supported (e4m3 only)")
    return tuple(int(b) for b in block)


def scale_name(weight: str) -> str:
    """The scale tensor of a quantized weight, as DeepSeek-V3's checkpoints and vLLM name it."""
    if not weight.endswith(".weight"):
        raise Error(f"'{weight}': only '.weight' tensors are quantized")
    return weight + "_scale_inv"


def tiles(shape: Sequence[int], block: Sequence[int]) -> List[int]:
    """A quantized tensor's scale shape: the leading dims, then the tile counts of the trailing ones."""
    lead = len(shape) - len(block)
    return [int(s) for s in shape[:lead]] + [math.ceil(s / b) for s, b in zip(shape[lead:], block)]


# ------------------------------------------------------------------------------------------- reference


def reference_quantize(x: Any, block: Sequence[int]) -> "Tuple[Any, Any]":
    """CONTRACT.md section 1's block scheme with torch ops: per tile (partial tiles at the ends are tiles),
    in f32, ``amax = max(max|x|, 1e-4)``, ``q = e4m3(x * (448 / amax))`` (the quotient rounded to f32 first,
    torch's round-to-nearest-even cast, magnitudes past 448 saturated), scale ``amax / 448``. Returns
    (``float8_e4m3fn`` tensor, f32 scale tensor) for a 2-D tensor."""
    import torch

    if x.dim() != len(block) or len(block) != 2:
        raise Error(f"reference_quantize: a 2-D tensor and a 2-D block, not {tuple(x.shape)} and {tuple(block)}")
    (R, C), (br, bc) = x.shape, block
    nr, nc = math.ceil(R / br), math.ceil(C / bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:R, :C] = x.float()  # zeros do not change a tile's amax
    t = padded.reshape(nr, br, nc, bc)
    amax = t.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    mul = torch.tensor(E4M3_MAX, dtype=torch.float32) / amax
    q = (t * mul).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(nr * br, nc * bc)[:R, :C]
    return q.contiguous(), (amax / E4M3_MAX).reshape(nr, nc)


def checkpoint_quantized(name: str, shape: Sequence[int]) -> bool:
    """Whether an FP8 checkpoint of DeepSeek-V3's kind holds this tensor in e4m3 (2-D projections of the
    decoder layers)."""
    return len(shape) == 2 and bool(_CHECKPOINT_FP8.search(name))


def reference_checkpoint(state: Iterable[Tuple[str, Any]], block: Sequence[int]) -> Iterator[Tuple[str, Any]]:
    """The block-FP8 checkpoint of a BF16 state dict, as DeepSeek-V3's are made: each decoder-layer
    projection's weight in e4m3 followed by its ``weight_scale_inv``, every other tensor as it is."""
    for name, t in state:
        if checkpoint_quantized(name, t.shape):
            q, s = reference_quantize(t, block)
            yield name, q
            yield scale_name(name), s
        else:
            yield name, t


# ------------------------------------------------------------------------------------- destination


def quantized_names(model: Any, checkpoint: Sequence[Tuple[str, Sequence[int], Any]], gather) -> "set[str]":
    """The checkpoint tensors the engine's loader copies into an FP8 parameter, over every rank."""
    from .vllm import trace_rank

    mine = trace_rank(model, checkpoint, {})
    local = sorted({pc.tensor for pt in mine.params if pt.dtype == "fp8e4m3" for pc in pt.pieces})
    return {n for part in gather(local) for n in part}


def fp8_checkpoint(checkpoint: Sequence[Tuple[str, Sequence[int], Any]], quantized: "set[str]",
                   block: Sequence[int]) -> List[Tuple[str, List[int], str]]:
    """The FP8 checkpoint's tensors ``(name, shape, dtype)``: each quantized one in e4m3 followed by its
    scale tensor."""
    out = []
    for name, shape, dtype in checkpoint:
        if name not in quantized:
            out.append((name, list(shape), dtype))
            continue
        if dtype not in ("bf16", "f16", "f32"):
            raise Error(f"'{name}': a {dtype} tensor cannot be quantized to FP8 (bf16, f16 or f32)")
        if len(shape) != len(block):
            raise Error(f"'{name}' {list(shape)}: the engine quantizes it, but its rank differs from the block "
                        f"{list(block)}'s")
        out.append((name, list(shape), "fp8e4m3"))
        out.append((scale_name(name), tiles(shape, block), "f32"))
    return out


def post_processing_refusals(model: Any) -> List[str]:
    """Each FP8 module whose weights or scales vLLM's post-processing turned into something other than the
    checkpoint layout a refit writes, with the transform (empty: the refit leaves the model as a fresh load
    would). Known to keep the layout: the CPU block kernel under :func:`allow_block_fp8_on_cpu`. Refused until
    their post-processing is re-run after each update: other linear kernels (the GPU ones transpose, pad or
    requantize scales: DeepGEMM's UE8M0, CUTLASS's column-major scales; the AMX one packs weights for VNNI)
    and FP8 MoE experts (shuffled or padded for their kernel; on the CPU, where vLLM has no FP8 MoE kernel,
    :func:`allow_block_fp8_on_cpu` keeps their layout). MLA's dequantized ``W_UK_T`` / ``W_UV`` are redone
    after each refit instead (:func:`post_processing_refresh`)."""
    out = []
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        kernel = getattr(qm, "fp8_linear", None)
        if kernel is not None and not vars(type(kernel)).get("_reshard_allowed", False):  # not a subclass's
            out.append(f"{name}: FP8 linear kernel {type(kernel).__name__} (its post-processing may re-lay weights or "
                       "scales)")
        elif type(qm).__name__ == "Fp8MoEMethod" and not _layout_kept(qm):
            out.append(f"{name}: FP8 MoE experts, backend {getattr(qm, 'fp8_backend', '?')} (re-laid for its kernel)")
    return out


def _mla_copies(model: Any) -> List[Tuple[str, Any]]:
    """MLA modules whose W_UK_T / W_UV are dequantized copies of an FP8 kv_b_proj (in BF16 they are views of
    kv_b_proj's weight and follow a refit by themselves)."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "W_UK_T") and getattr(getattr(m, "kv_b_proj", None), "weight", None) is not None
            and m.kv_b_proj.weight.dtype != m.W_UK_T.dtype]


def post_processing_refresh(mla: List[Tuple[str, Any]], act_dtype: Any) -> Optional[Callable[[], None]]:
    """What brings the tensors vLLM's post-processing derives from refit ones up to date after a refit,
    in place (None: nothing to redo): each MLA module's (``mla``: :func:`_mla_copies`) own
    ``process_weights_after_loading`` again (its W_UK_T / W_UV from the new FP8 kv_b_proj and its scale), as
    vLLM's layerwise reload does. Each keeps its storage, so CUDA graphs captured over them stay valid; one
    that moved raises, naming it."""
    if not mla:
        return None

    def refresh() -> None:
        for name, m in mla:
            before = (m.W_UK_T.data_ptr(), m.W_UV.data_ptr())
            m.process_weights_after_loading(act_dtype)
            if (m.W_UK_T.data_ptr(), m.W_UV.data_ptr()) != before:
                raise Error(f"{name}: MLA's post-processing re-allocated W_UK_T / W_UV instead of rewriting them "
                            "in place (memory captured CUDA graphs read)")
    return refresh


def _layout_kept(moe_method: Any) -> bool:
    backend = getattr(moe_method, "fp8_backend", None)
    return vars(type(moe_method)).get("_reshard_allowed", False) and getattr(backend, "name", None) == "NONE"


def quantized_live_layout(model: Any, checkpoint: Sequence[Tuple[str, Sequence[int], Any]], block: Sequence[int],
                          *, act_dtype: Any, first_rank: int = 0):
    """A live block-FP8 vLLM model's layout (see the module's docstring): a
    :class:`reshard.engines.vllm.LiveLayout` whose quantized tensors carry ``quant``, whose scale tensors
    are bound to their rows of vLLM's fused scale parameters, and whose ``refresh()`` redoes what vLLM
    derives from them (:func:`post_processing_refresh`; ``act_dtype``: the model's dtype). ``checkpoint``:
    the trainer's BF16 tensors ``(name, shape, dtype)``."""
    from .vllm import _gather_torch, _vllm_mesh, live_layout

    refused = post_processing_refusals(model)
    if refused:
        raise Error(f"reshard: {len(refused)} FP8 modules were post-processed into a layout a refit does not "
                    f"write: {'; '.join(refused[:4])}" + (" ..." if len(refused) > 4 else ""))
    _, _, group = _vllm_mesh()
    quantized = quantized_names(model, checkpoint, _gather_torch(group))
    if not quantized:
        raise Error("reshard: the engine serves block FP8 but its loader copies no checkpoint tensor into an "
                    "FP8 parameter")
    live = live_layout(model, fp8_checkpoint(checkpoint, quantized, block), first_rank=first_rank)
    layout, views = quantized_layout(live.layout, quantized, block)
    buffers = dict(live.buffers)
    specs = {s["name"]: s for s in layout.buffers(live.rank)}
    for fused, parts in views.items():
        if fused not in live.buffers:  # another stage's, or experts this rank does not hold
            continue
        buffers.pop(fused)
        if not live.buffers[fused].is_contiguous():
            raise Error(f"rank {live.rank}: vLLM's scale parameter '{fused}' is not contiguous: its parts' rows "
                        "cannot be bound as views")
        flat, at = live.buffers[fused].view(-1), 0
        for spec in (specs[p] for p in parts if p in specs):  # memory order; parts this rank lacks add nothing
            buffers[spec["name"]] = flat[at:at + spec["elements"]].view(spec["shape"])
            at += spec["elements"]
        if at != flat.numel():
            raise Error(f"rank {live.rank}: '{fused}' holds {flat.numel()} scale entries, its parts {at}")
    log.info("block FP8 layout of rank %d: %d quantized tensors, %d fused scale parameters bound by rows",
             live.rank, len(quantized), len(views))
    # Parameters post-processing derives (MLA's W_UK_T / W_UV) are no loader's: the refresh redoes them.
    mla = _mla_copies(model)
    derived = {f"{n}.{t}": getattr(m, t) for n, m in mla for t in ("W_UK_T", "W_UV")}
    return dataclasses.replace(live, layout=layout, buffers=buffers, parameters=dict(live.buffers),
                               post_processing=post_processing_refresh(mla, act_dtype),
                               untraced={n: why for n, why in live.untraced.items() if n not in derived},
                               untraced_bytes=live.untraced_bytes - sum(t.numel() * t.element_size()
                                                                        for t in derived.values()))


def quantized_layout(layout: Any, quantized: "set[str]", block: Sequence[int]) -> "Tuple[Any, Dict[str, List[str]]]":
    """``layout`` (traced from an FP8 checkpoint) with each quantized tensor marked ``quant`` (block scheme,
    its scale tensor) and each concat buffer of scale tensors taken apart (the core stores a scale tensor
    alone). Returns the layout and, per buffer taken apart, its parts in memory order."""
    doc = json.loads(layout.to_json())
    names = {t["name"] for t in doc["tensors"]}
    for t in doc["tensors"]:
        if t["name"] in quantized:
            if scale_name(t["name"]) not in names:
                raise Error(f"{layout.origin}: '{t['name']}' is FP8 but its scale '{scale_name(t['name'])}' is not traced")
            t["quant"] = {"scheme": "block", "block": list(block), "scale": scale_name(t["name"])}
    scales = {scale_name(n) for n in quantized}
    kept, apart = [], {}
    for b in doc.get("buffers", []):
        inside = [p for p in b["parts"] if p in scales]
        if not inside:
            kept.append(b)
            continue
        if len(inside) != len(b["parts"]) or "flat" in b or b.get("dim", 0) != 0 or b.get("interleave", 1) != 1:
            raise Error(f"{layout.origin}: buffer '{b['name']}' holds scale tensors {inside[:3]} beside other "
                        f"tensors or not as a one-round concat along dim 0: its scale tensors cannot be bound")
        apart[b["name"]] = list(b["parts"])
    doc["buffers"] = kept
    return layout_from_json(json.dumps(doc), layout.origin + ", block FP8"), apart


# ------------------------------------------------------------------------------------------- the CPU


def allow_block_fp8_on_cpu() -> None:
    """Lets vLLM 0.33 build and post-process block-FP8 models on a CPU without AMX (the CUDA wheel has none
    of its CPU FP8 ops): its CPU block-FP8 kernel is declared supported, and its weight post-processing
    keeps the checkpoint layout (no VNNI packing); FP8 MoE experts, which get no kernel on the CPU (backend
    NONE), keep theirs too instead of failing. No GEMM runs on such a model: for tests and dry runs, never
    for serving. Idempotent."""
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
    from vllm.model_executor.layers.quantization.utils import replace_parameter

    if getattr(CPUFp8BlockScaledMMKernel, "_reshard_allowed", False):
        return

    def process_weights_after_loading(self, layer):
        if getattr(layer, "_cpu_skip_gemm_dispatch", False):
            return
        import torch

        scale = self._get_layer_params(layer).weight_scale_inv
        replace_parameter(layer, "weight_scale_inv", torch.nn.Parameter(scale.data.contiguous(), requires_grad=False))

    CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    CPUFp8BlockScaledMMKernel.process_weights_after_loading = process_weights_after_loading
    CPUFp8BlockScaledMMKernel._reshard_allowed = True

    moe_post_processing = Fp8MoEMethod.process_weights_after_loading

    def moe_process_weights_after_loading(self, layer):
        if getattr(self.fp8_backend, "name", None) != "NONE":
            return moe_post_processing(self, layer)

    Fp8MoEMethod.process_weights_after_loading = moe_process_weights_after_loading
    Fp8MoEMethod._reshard_allowed = True
