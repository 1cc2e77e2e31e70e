"""One vLLM rank (tp=1) of a tiny DeepSeek-V3-style model (MLA + MoE), built on this CPU by vLLM's own
loader, for test_fp8_engines.py. Prints one JSON line.

    python fp8_worker.py CONFIG WORK PORT fp8   the model in block FP8: what reshard's FP8 setup refuses where
                                               its MoE experts are re-laid for a kernel (as on a GPU)
    python fp8_worker.py CONFIG WORK PORT bf16  in BF16, MLA's post-processing run: are W_UK_T / W_UV views
                                               of kv_b_proj's weight (so a refit of kv_b_proj reaches them)?
"""
import json
import os
import pathlib
import sys

config, work, port, kind = sys.argv[1:5]
from reshard.engines import cpu  # noqa: E402

os.environ.update(cpu.vllm_env(pathlib.Path(work)), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
import torch  # noqa: E402

import reshard  # noqa: E402
from reshard.engines import fp8  # noqa: E402
from reshard.engines.vllm_meta import checkpoint_tensors  # noqa: E402

cfg = json.loads(pathlib.Path(config).read_text())
if kind == "fp8":
    cfg["quantization_config"] = fp8.DEEPSEEK_V3_FP8
model, vcfg = cpu.vllm_model(cpu.vllm_model_dir(cfg, pathlib.Path(work)), 1)
if kind == "fp8":
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
    ckpt = [(n, list(s), "bf16") for n, s, _ in checkpoint_tensors(config)]
    out = {"kept": fp8.post_processing_refusals(model)}
    Fp8MoEMethod._reshard_allowed = False  # as where vLLM has an FP8 MoE kernel: the experts are re-laid for it
    try:
        fp8.quantized_live_layout(model, ckpt, fp8.block_of(cfg), act_dtype=vcfg.model_config.dtype)
        out["refused"] = None
    except reshard.Error as e:
        out["refused"] = str(e)
    print(json.dumps(out))
else:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    mla = [m for m in model.modules() if is_deferred_attention_layer(m)]
    for m in mla:  # MLA's own post-processing (the MoE one is a CPU prepack the CUDA wheel lacks)
        m.process_weights_after_loading(vcfg.model_config.dtype)
    out = []
    for m in mla:
        w = m.kv_b_proj.weight
        views = [m.W_UK_T.untyped_storage().data_ptr() == w.untyped_storage().data_ptr(),
                 m.W_UV.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()]
        with torch.no_grad():  # a refit's write into kv_b_proj: W_UK_T / W_UV must follow it
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(w.dtype))
        n_heads = m.W_UV.shape[0]
        kv_b = w.detach().view(n_heads, -1, w.shape[1])  # per head [nope + v, kv_lora]
        nope = m.W_UK_T.shape[1]  # W_UK_T [heads, nope, kv_lora], W_UV [heads, kv_lora, v]
        follows = torch.equal(m.W_UK_T, kv_b[:, :nope]) and torch.equal(m.W_UV, kv_b[:, nope:].transpose(1, 2))
        out.append({"views": views, "follows": follows})
    print(json.dumps({"mla": out}))
