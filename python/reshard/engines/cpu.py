"""Live engines on a CPU, one process per rank (docs/vllm.md, "Running vLLM on a CPU"): what the engine
tests, ``examples/python/vllm_rl_loop.py`` and a user unit-testing a refit on a laptop build.

* vLLM 0.33 (its own venv): :func:`vllm_env`, then :func:`vllm_model` builds the real model class of a
  ``config.json`` with vLLM's own loader (no weights) for one rank of a tp (and ep) engine, and
  :func:`vllm_load` is vLLM's own ``load_weights``: the reference every refit is compared with. The
  caller sets MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK for vLLM's own gloo group.
* FSDP2 (any torch): :func:`fsdp_model` is a HuggingFace model of a config, one gloo process per rank,
  ``fully_shard`` per decoder layer and at the root (as veRL, SkyRL and TRL shard).
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch

#: The HF model_type of each architecture the example configs use (they do not all spell it).
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
               "DeepseekV3ForCausalLM": "deepseek_v3", "Phi3ForCausalLM": "phi3", "Glm4ForCausalLM": "glm4"}


def model_type(cfg: Mapping) -> str:
    """The HuggingFace ``model_type`` of a config.json dict (given, or from its architecture)."""
    if cfg.get("model_type"):
        return cfg["model_type"]
    arch = (cfg.get("architectures") or ["<none>"])[0]
    if arch not in MODEL_TYPES:
        raise ValueError(f"config.json: no model_type and architecture '{arch}' is not one of {sorted(MODEL_TYPES)}")
    return MODEL_TYPES[arch]


def hf_model(cfg: Mapping, *, seed: int = 0, dtype=torch.bfloat16):
    """A HuggingFace causal LM of ``cfg`` (a config.json dict), initialised from ``seed`` (the same on every
    rank that passes the same seed)."""
    import transformers

    hf = transformers.AutoConfig.for_model(model_type(cfg),
                                           **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf, dtype=dtype)


def fsdp_model(cfg: Mapping, weights: Optional[Mapping[str, torch.Tensor]] = None, *, seed: int = 0,
               master_f32: bool = False):
    """This rank's FSDP2 model: ``weights`` (HF name -> full tensor) when given, else initialised from
    ``seed`` alike on every rank; gloo initialised here when it is not yet. bf16 parameters, or with
    ``master_f32`` f32 sharded parameters computed in bf16 (``MixedPrecisionPolicy``, as veRL runs FSDP2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("fsdp",))
    model = hf_model(cfg, seed=seed, dtype=torch.float32 if master_f32 else torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if master_f32 else None
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or any("rotary" not in m for m in missing):
            raise ValueError(f"fsdp_model: the weights do not fit the model: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
    kw = {"mp_policy": policy} if policy is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def vllm_env(work: pathlib.Path) -> Dict[str, str]:
    """The environment a vLLM CPU process needs (set before vLLM is imported): everything it writes
    stays under ``work``."""
    work = pathlib.Path(work)
    work.mkdir(parents=True, exist_ok=True)
    return {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "XDG_CACHE_HOME": str(work / "cache"),
            "HF_HOME": str(work / "hf"), "TMPDIR": str(work), "VLLM_RPC_BASE_PATH": str(work),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "GLOO_SOCKET_IFNAME": "lo",
            "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_HOST_IP": "127.0.0.1"}


def vllm_model_dir(cfg: Mapping, work: pathlib.Path) -> pathlib.Path:
    """A folder vLLM reads as a model: its config.json only (load_format="dummy", no tokenizer)."""
    d = pathlib.Path(work) / "model"
    d.mkdir(parents=True, exist_ok=True)
    c = dict(cfg)
    c["model_type"] = model_type(c)
    c.setdefault("max_position_embeddings", 512)
    if c["architectures"][0] == "DeepseekV3ForCausalLM":
        c.setdefault("topk_method", "noaux_tc")  # HF's default: the router has e_score_correction_bias
    (d / "config.json").write_text(json.dumps(c))
    return d


def vllm_model(model_path: pathlib.Path, tp: int, *, expert_parallel: bool = False):
    """This process's rank of a vLLM engine: the bare module (no weights loaded) and its VllmConfig."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_path), skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                      tensor_parallel_size=tp, enable_expert_parallel=expert_parallel,
                      distributed_executor_backend="external_launcher", enforce_eager=True, max_model_len=256)
    cfg = args.create_engine_config()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ctx = set_current_vllm_config(cfg)
    ctx.__enter__()  # kept for the life of the process: loaders read the current config
    init_distributed_environment(world, rank, "env://", int(os.environ.get("LOCAL_RANK", rank)), backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=tp)
    return vllm_module(cfg), cfg


def vllm_module(cfg, device: str = "cpu"):
    """vLLM's model class of ``cfg`` (a VllmConfig whose parallel state is set up), built bare by vLLM's
    own loader on ``device``; a block-FP8 model with :func:`reshard.engines.fp8.allow_block_fp8_on_cpu`; then
    post-processed as after a load (a block-FP8 model whole; otherwise MLA only). A process may build
    several: attention layers register their names in the config's forward context, cleared first (no
    forward runs here)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    from .fp8 import allow_block_fp8_on_cpu, block_of

    fp8 = block_of(cfg.model_config.hf_config) is not None
    if fp8:
        allow_block_fp8_on_cpu()
    cfg.compilation_config.static_forward_context.clear()
    with set_default_torch_dtype(torch.bfloat16), torch.device(device):
        model = get_model_loader(cfg.load_config).create_model(vllm_config=cfg, model_config=cfg.model_config)
    # As vLLM's loader after a load: a block-FP8 model's post-processing (the unused KV-cache scales go, MLA
    # dequantizes W_UK_T / W_UV); otherwise MLA's alone (W_UK_T / W_UV views of kv_b_proj), as the others' is a
    # CPU prepack the CUDA wheel lacks.
    if fp8:
        process_weights_after_loading(model, cfg.model_config, torch.device(device))
    else:
        for m in model.modules():
            if is_deferred_attention_layer(m) and hasattr(m, "kv_b_proj"):  # MLA
                m.process_weights_after_loading(cfg.model_config.dtype)
    return model


def vllm_load(model, tensors: Iterable[Tuple[str, torch.Tensor]]):
    """vLLM's own loader: the reference every refit is compared with."""
    with torch.no_grad():
        return model.load_weights(iter(tensors))


def differing_parameters(model, reference: Iterable[Tuple[str, torch.Tensor]]) -> "list[str]":
    """Each parameter of a live vLLM ``model`` that differs, bit for bit, from what vLLM's own loader
    makes of ``reference`` (a full state dict), with how many elements differ. The model is left holding
    the loader's result."""
    params = dict(model.named_parameters())
    got = {n: p.detach().clone() for n, p in params.items()}
    vllm_load(model, reference)

    def bits(t):
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

    return [f"{n}: {int((got[n] != p.detach()).sum())} of {p.numel()} elements differ"
            for n, p in params.items() if not torch.equal(bits(got[n]), bits(p.detach()))]


def what_parameters_hold(model, new: Iterable[Tuple[str, torch.Tensor]], old: Iterable[Tuple[str, torch.Tensor]]
                         ) -> "dict[str, str]":
    """Per parameter of a live vLLM ``model``, from its memory, element by element, against what vLLM's own
    loader makes of two full state dicts: ``written`` (every element as ``new`` loads it), ``untouched``
    (as ``old`` does), ``partial`` (each element one or the other, some of each), ``same`` (the two
    versions agree on every element: either), or how many elements match neither. The model is left as
    it was."""
    params = dict(model.named_parameters())
    now = {n: p.detach().clone() for n, p in params.items()}

    def loaded(tensors):
        vllm_load(model, tensors)
        return {n: p.detach().clone() for n, p in params.items()}

    want_new, want_old = loaded(new), loaded(old)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(now[n])
    out = {}
    for n in params:
        a, b, g = want_new[n], want_old[n], now[n]
        is_new, is_old = _bits(g) == _bits(a), _bits(g) == _bits(b)
        if torch.equal(_bits(a), _bits(b)):
            out[n] = "same" if is_new.all() else f"{int((~is_new).sum())} elements of neither version"
        elif not (is_new | is_old).all():
            out[n] = f"{int((~(is_new | is_old)).sum())} elements of neither version"
        else:
            out[n] = "written" if is_new.all() else "untouched" if is_old.all() else "partial"
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns to compare (a NaN equals itself; -0 differs from 0)."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


#: Bit patterns a refit never writes: a quiet NaN with a payload no cast or copy of real weights makes (FP8:
#: e4m3's NaN, which the saturating quantizer never makes).
JUNK_BITS = {1: 0x7F, 2: 0x7FA5, 4: 0x7FC0A5A5, 8: 0x7FF8A5A5A5A5A5A5}
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def _negated(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every sign bit flipped: -t for any float dtype, FP8 included (which torch cannot negate)."""
    bits = _as_bits(t)
    return torch.bitwise_xor(bits, torch.iinfo(bits.dtype).min).view(t.dtype)


def _junk(t: torch.Tensor) -> int:
    v = JUNK_BITS[t.element_size()]
    return v - (1 << 8 * t.element_size()) if v >= 1 << (8 * t.element_size() - 1) else v


class LoadedTwin:
    """A second instance of a live vLLM rank's model, built by vLLM's loader from the same config and
    loaded only by vLLM's own ``load_weights``: the reference a refit of the live model is checked against,
    without ever writing the model under test.

    At construction it finds, by vLLM's loader alone, which elements of each parameter a load writes from
    the checkpoint (``from_checkpoint``): it loads a checkpoint and the same checkpoint negated, both from
    junk, and keeps the elements that differ (a sign survives any cast or copy; -0 differs from 0). Elements the loader
    leaves alone or fills with a constant (vocabulary padding) are not the checkpoint's: a refit need not
    write them. Before a dense refit the live model's checkpoint elements are set to junk
    (:meth:`junk_fill`), so a write the refit misses shows however little the value changed; the bytes
    a rank must receive are counted from these elements (:meth:`checkpoint_bytes`), not from reshard.
    Parameters that are views into another's storage (MLA's BF16 W_UK_T / W_UV) are that one's elements:
    left out, never counted twice."""

    def __init__(self, model, vllm_config, checkpoint: Mapping[str, torch.Tensor]):
        from .vllm import views_of_other_parameters

        views = views_of_other_parameters(model)
        self.params = {n: p for n, p in model.named_parameters() if n not in views}
        self.twin = vllm_module(vllm_config)
        self.twin_params = {n: p for n, p in self.twin.named_parameters() if n not in views}
        missing = sorted(set(self.params) ^ set(self.twin_params))
        if missing:
            raise ValueError(f"the twin model's parameters differ from the live model's: {missing[:4]}")
        self._load_from_junk(checkpoint.items())
        first = {n: _as_bits(p.detach()).clone() for n, p in self.twin_params.items()}
        self._load_from_junk((n, _negated(t)) for n, t in checkpoint.items())
        self.from_checkpoint = {n: first.pop(n) != _as_bits(p.detach()) for n, p in self.twin_params.items()}

    def _load_from_junk(self, tensors) -> None:
        with torch.no_grad():
            for p in self.twin_params.values():
                _as_bits(p.detach()).fill_(_junk(p))
        vllm_load(self.twin, tensors)

    def checkpoint_bytes(self) -> int:
        """The bytes of this rank's parameters that a load writes from the checkpoint."""
        return sum(int(m.sum()) * self.params[n].element_size() for n, m in self.from_checkpoint.items())

    def junk_fill(self) -> None:
        """The live model's checkpoint elements set to junk: what a refit must overwrite, every one."""
        with torch.no_grad():
            for n, p in self.params.items():
                _as_bits(p.detach())[self.from_checkpoint[n]] = _junk(p)

    def differences(self, reference: Iterable[Tuple[str, torch.Tensor]]) -> "list[str]":
        """Each live parameter whose checkpoint elements differ, bit for bit, from what vLLM's
        ``load_weights`` of ``reference`` (a full state dict) writes into the twin, with how many differ
        and how many of those still hold junk (writes the refit missed)."""
        vllm_load(self.twin, reference)
        bad = []
        for n, p in self.params.items():
            m = self.from_checkpoint[n]
            got, want = _as_bits(p.detach())[m], _as_bits(self.twin_params[n].detach())[m]
            if not torch.equal(got, want):
                junk = int((got == _junk(p)).sum())
                bad.append(f"{n}: {int((got != want).sum())} of {int(m.sum())} elements differ"
                           + (f", {junk} of them never written (junk)" if junk else ""))
        return bad
