"""One process of a refit from a Megatron-Core layout into a live vLLM engine (the engines venv).

  refit_worker.py source  --rank R ...   a training rank: reshard.megatron_layout's buffers, filled from the
                                         seeded checkpoint by the contract oracle (oracle.contract_buffers)
  refit_worker.py vllm    --rank R ...   an inference rank: a live vLLM model on the CPU, its layout traced
                                         through vLLM's loader (reshard.engines.vllm.live_layout)

Both read and write through a TCPStore the test hosts. The vLLM rank serves version 0 (vLLM's own
load_weights), then takes version 1 by a reshard refit into its live parameters (their checkpoint
elements set to junk first), then compares every parameter, bit for bit, with vLLM's own load_weights of
version 1 into a twin model (cpu.LoadedTwin), which also counts the bytes the rank must receive. It also binds the live model to
reshard.vllm_layout (the preset) and checks that the preset puts every slot where the trace does, and
that a missing, renamed, reshaped or retyped parameter fails naming it. The result is one JSON file.
"""
import argparse
import datetime
import json
import os
import pathlib
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # oracle.py
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import oracle  # noqa: E402
import reshard  # noqa: E402

UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["source", "megatron", "fsdp", "whole", "vllm"])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--first-rank", type=int, required=True, help="the vLLM engine's first global rank")
    ap.add_argument("--ep", action="store_true")
    ap.add_argument("--bridge", action="store_true", help="live Megatron ranks load version 1 by Megatron-Bridge")
    ap.add_argument("--fail-trace", type=int, default=-1, help="this vLLM rank's trace fails (a planted fault)")
    ap.add_argument("--plant-expert-swap", action="store_true",
                    help="a planted fault: the Megatron layout swaps local experts 0 and 1 of every MoE layer")
    ap.add_argument("--fp8", action="store_true",
                    help="the vLLM engine serves block FP8 (DeepSeek-V3's quantization_config): quantized in flight, "
                    "checked against vLLM's load_weights of the reference FP8 checkpoint")
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.update(UCX_ENV)
    out = {"role": a.role, "rank": a.rank}
    try:
        store = torch.distributed.TCPStore("127.0.0.1", a.store_port, None, False,
                                           timeout=datetime.timedelta(seconds=180))
        cfg_path = pathlib.Path(a.config)
        # The checkpoint: HF names and shapes (the presets' global tensors; with --train whole, the
        # transformers model's: architectures no preset knows), seeded values per version.
        ckpt = whole_layout(cfg_path) if a.train == "whole" else reshard.megatron_layout(cfg_path, "tp=1")
        full1 = oracle.full_tensors(ckpt, seed=1)
        if a.role == "whole":  # one rank holding the whole checkpoint, split as the engine's trace asks
            from reshard.engines.rows import split_rows

            dst = reshard.layout_from_json(store.get("dst_layout").decode(), "the traced vLLM layout")
            src = split_rows(ckpt, dst)
            bufs = {b["name"]: full1[b["name"]] for b in src.buffers(a.rank)}
            with reshard.Resharder(src, dst, rank=a.rank, buffers=bufs, transport="ucx", store=store) as r:
                out["report"] = r.refit()
            out["ok"] = True
        elif a.role == "fsdp":
            out["report"] = run_fsdp(a, store, cfg_path, full1)
            out["ok"] = True
        elif a.train.startswith("fsdp"):  # a vLLM rank of an FSDP2 job: the trainer publishes its layout
            src = reshard.layout_from_json(store.get("src_layout").decode(), "the FSDP2 trainer's layout")
            out.update(run_vllm(a, store, src, ckpt, full1, cfg_path))
        elif a.role == "megatron":
            out["report"] = run_megatron(a, store, megatron_source(a, cfg_path), cfg_path, full1)
            out["ok"] = True
        elif a.role == "source":
            src = reshard.megatron_layout(cfg_path, a.train)
            bufs = {n: v.clone() for n, (v, _) in oracle.contract_buffers(src, full1, a.rank).items()}
            dst = reshard.layout_from_json(store.get("dst_layout").decode(), "the traced vLLM layout")
            with reshard.Resharder(src, dst, rank=a.rank, buffers=bufs, transport="ucx", store=store) as r:
                out["report"] = r.refit()
            out["ok"] = True
        else:
            src = ckpt if a.train == "whole" else megatron_source(a, cfg_path)
            out.update(run_vllm(a, store, src, ckpt, full1, cfg_path))
    except reshard.Error as e:
        out.update(ok=False, error=str(e), kind=type(e).__name__)
    except BaseException:
        out.update(ok=False, error=traceback.format_exc(), kind="crash")
    pathlib.Path(a.out).write_text(json.dumps(out))


def megatron_source(a, cfg_path):
    """reshard.megatron_layout of the training spec; with --plant-expert-swap, local experts 0 and 1 of
    every MoE layer swapped (a wrong local expert index, planted)."""
    src = reshard.megatron_layout(cfg_path, a.train)
    if not a.plant_expert_swap:
        return src
    j = json.loads(src.to_json())
    by_name = {b["name"]: b for b in j["buffers"]}
    for b in j["buffers"]:
        if ".local_experts.0." in b["name"]:
            other = by_name[b["name"].replace(".local_experts.0.", ".local_experts.1.")]
            b["parts"], other["parts"] = other["parts"], b["parts"]
    return reshard.layout_from_json(json.dumps(j), "the Megatron layout with local experts 0 and 1 swapped")


def run_megatron(a, store, src, cfg_path, full1):
    """A training rank of a live Megatron-Core GPTModel (local layer spec, gloo, under the Float16Module
    mixed-precision wrapper), bound to reshard.megatron_layout by its own parameter names, version 1
    loaded by Megatron's own code and checked against what the layout says, then refit from its
    parameters."""
    import megatron_cpu
    from reshard.engines import bind_parameters
    from reshard.engines.megatron import build, load_experts

    cfg = json.loads(cfg_path.read_text())
    model = build(cfg, a.train)
    bufs = bind_parameters(model.named_parameters(), src, a.rank, engine="the live GPTModel")
    # Version 1 by Megatron's own code; it must equal what the preset says each parameter holds (the
    # contract oracle over reshard.megatron_layout), real elements only. --bridge: Megatron-Bridge's
    # conversion. Without it (Bridge 0.6 fails on SequentialMLP experts) each routed expert is loaded by
    # Megatron-Core's own expert placement (reshard.engines.megatron.load_experts), so the layout's local expert
    # indices are checked here; the oracle writes the other parameters by the model's own names.
    expected = oracle.contract_buffers(src, full1, a.rank)
    if a.bridge:
        megatron_cpu.bridge_load(model, cfg, full1, pathlib.Path(a.work))
    else:
        with torch.no_grad():
            for n, t in bufs.items():
                if ".local_experts." not in n:
                    t.view(-1).copy_(expected[n][0].reshape(-1))
        experts = load_experts(model, full1)
        if experts != sum(".local_experts." in n and n.endswith("linear_fc1.weight") for n in bufs):
            raise reshard.Error(f"rank {a.rank}: Megatron placed {experts} local experts; the layout binds "
                                f"{sum('.local_experts.' in n for n in bufs) // 2}")
    bad = []
    for n, t in bufs.items():
        v, m = expected[n]
        got = t.reshape(v.shape)
        if not torch.equal(got[m], v[m]):
            bad.append(f"{n}: {int((got[m] != v[m]).sum())} of {int(m.sum())} elements differ")
    if bad:
        raise reshard.Error(f"rank {a.rank}: Megatron's own load differs from reshard.megatron_layout: "
                            + "; ".join(bad[:6]))
    dst = reshard.layout_from_json(store.get("dst_layout").decode(), "the traced vLLM layout")
    with reshard.Resharder(src, dst, rank=a.rank, buffers=bufs, transport="ucx", store=store) as r:
        report = r.refit()
    report["parameters"] = len(bufs)
    return report


def run_fsdp(a, store, cfg_path, full1):
    """A training rank of an FSDP2 (fully_shard) HuggingFace model on gloo, version 1 loaded, its
    layout read from its DTensor parameters (reshard.engines.dtensor)."""
    from reshard.engines.cpu import fsdp_model
    from reshard.engines.dtensor import dtensor_layout

    model = fsdp_model(json.loads(cfg_path.read_text()), full1)
    layout, bufs = dtensor_layout(model.named_parameters(), first_rank=0, origin="fsdp2 trainer")
    if a.rank == 0:
        store.set("src_layout", layout.to_json())
    dst = reshard.layout_from_json(store.get("dst_layout").decode(), "the traced vLLM layout")
    with reshard.Resharder(layout, dst, rank=a.rank, buffers=bufs, transport="ucx", store=store) as r:
        report = r.refit()
    torch.distributed.destroy_process_group()
    return report


def whole_layout(cfg_path):
    """The checkpoint as one rank holding every tensor whole (names and shapes of the transformers model)."""
    from reshard.engines.vllm_meta import checkpoint_tensors

    tensors = [{"name": n, "shape": list(s), "dtype": d} for n, s, d in checkpoint_tensors(cfg_path)]
    return reshard.layout_from_json(json.dumps({"mesh": {"axes": [["dp", 1]]}, "tensors": tensors}),
                                    "the whole checkpoint")


def run_vllm(a, store, src, ckpt, full1, cfg_path):
    from reshard.engines import cpu
    from reshard.engines import vllm as rv
    from reshard.engines.rows import split_rows

    work = pathlib.Path(a.work)
    os.environ.update(cpu.vllm_env(work))
    from reshard.engines import fp8
    cfg = json.loads(cfg_path.read_text())
    if a.fp8:
        cfg["quantization_config"] = fp8.DEEPSEEK_V3_FP8
    model, vcfg = cpu.vllm_model(cpu.vllm_model_dir(cfg, work.parent / "model-dir"), a.tp, expert_parallel=a.ep)
    vrank = int(os.environ["RANK"])

    def checkpoint_of(full):  # what vLLM's loader reads: the state, or its reference FP8 checkpoint
        return dict(fp8.reference_checkpoint(full.items(), fp8.block_of(cfg))) if a.fp8 else full
    # Version 0 served first, as an engine that has loaded its checkpoint (and post-processed it: vllm_model).
    cpu.vllm_load(model, checkpoint_of(oracle.full_tensors(ckpt, seed=0)).items())
    mla = mla_layers(model)
    params = dict(model.named_parameters())
    checkpoint = [(n, tuple(t.shape), "bf16") for n, t in full1.items()]
    load = None
    if vrank == a.fail_trace:
        def load(weights):
            next(iter(weights))
            raise RuntimeError("planted: this rank's loader fails")
    t0 = time.monotonic()
    try:
        if a.fp8:
            live = fp8.quantized_live_layout(model, checkpoint, fp8.block_of(cfg), act_dtype=vcfg.model_config.dtype,
                                             first_rank=a.first_rank)
        else:
            live = rv.live_layout(model, checkpoint, first_rank=a.first_rank, load=load)
    except reshard.Error as e:
        if a.fail_trace < 0:
            raise
        return {"ok": False, "error": str(e), "kind": "trace", "seconds": time.monotonic() - t0}
    src = split_rows(src, live.layout)  # rows of fused checkpoint tensors: ranges of their own
    res = {"trace_seconds": live.seconds, "untraced": live.untraced, "untraced_bytes": live.untraced_bytes,
           "traced_bytes": live.traced_bytes, "global_rank": live.rank}
    if vrank == 0:
        store.set("dst_layout", live.to_json())
    res["preset"] = None if a.train == "whole" or a.fp8 else check_preset(cfg_path, a, live, params)
    # The reference: a twin of the model loaded by vLLM's own load_weights. What this rank must receive
    # is counted from the elements that loader writes (not from reshard's trace), and the refit lands
    # in memory set to junk there, so every write it misses shows.
    twin = cpu.LoadedTwin(model, vcfg, checkpoint_of(full1))
    res["needed_bytes"] = twin.checkpoint_bytes()
    res["traced_real_bytes"] = live.real_bytes
    twin.junk_fill()
    with reshard.Resharder(src, live.layout, rank=live.rank, buffers=live.buffers, transport="ucx", store=store) as r:
        res["report"] = r.refit()
    live.refresh()  # what vLLM derives from the refit weights (MLA's W_UK_T / W_UV of an FP8 kv_b_proj)
    bad = twin.differences(checkpoint_of(full1).items())
    if mla:
        res["derived"] = derived_differences(mla, twin.twin, vcfg)
        bad += res["derived"]["differ"]
    if a.fp8:  # where vLLM has an FP8 MoE kernel (a GPU), it re-lays the experts: the FP8 setup must refuse them
        from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
        Fp8MoEMethod._reshard_allowed = False
        res["refused_with_moe_kernel"] = fp8.post_processing_refusals(model)
    res.update(ok=not bad, mismatches=bad, params=len(params),
               elements=sum(p.numel() for p in params.values()))
    return res


def mla_layers(model):
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    return [(n, m) for n, m in model.named_modules() if is_deferred_attention_layer(m) and hasattr(m, "kv_b_proj")]


def derived_differences(live, twin, vcfg):
    """MLA's W_UK_T / W_UV of the live model after the refit (views of kv_b_proj in BF16; in FP8 dequantized
    copies, refreshed) against the twin's, which vLLM's own MLA post-processing derives from the twin's
    loaded weights: names of those that differ."""
    ref = dict(mla_layers(twin))
    differ = []
    for n, m in live:
        ref[n].process_weights_after_loading(vcfg.model_config.dtype)
        for t in ("W_UK_T", "W_UV"):
            if not torch.equal(getattr(m, t).view(torch.int16), getattr(ref[n], t).view(torch.int16)):
                differ.append(f"{n}.{t}")
    return {"compared": 2 * len(live), "differ": differ}


def check_preset(cfg_path, a, live, params):
    """The preset for this vLLM release against the live model: same buffers, every slot the same
    checkpoint element as the trace; and bind_parameters' errors for planted mismatches."""
    from reshard.engines import bind_parameters

    spec = f"tp={a.tp}" + (f",ep={a.tp}" if a.ep else "")
    preset = reshard.vllm_layout(cfg_path, spec, first_rank=live.layout.ranks[0])
    rank = live.rank
    bound = bind_parameters(params.items(), preset, rank, engine="the live vLLM model")
    traced = {b["name"] for b in live.layout.buffers(rank)}
    assert set(bound) == traced, f"preset buffers {sorted(set(bound) ^ traced)} differ from the trace"
    for n in sorted(traced):
        assert preset.slot_runs(rank, n) == live.layout.slot_runs(rank, n), f"preset and trace differ on {n}"
    errors = {}
    name = sorted(bound)[len(bound) // 2]
    planted = {
        "missing": {k: v for k, v in params.items() if k != name},
        "renamed": {(k + "_old" if k == name else k): v for k, v in params.items()},
        "reshaped": {k: (v.detach().reshape(-1)[:-1] if k == name else v) for k, v in params.items()},
        "retyped": {k: (v.detach().float() if k == name else v) for k, v in params.items()},
    }
    for kind, named in planted.items():
        try:
            bind_parameters(named, preset, rank, engine="the live vLLM model")
            errors[kind] = None
        except reshard.Error as e:
            errors[kind] = str(e)
    return {"buffers": len(bound), "planted": name, "errors": errors}


if __name__ == "__main__":
    main()
