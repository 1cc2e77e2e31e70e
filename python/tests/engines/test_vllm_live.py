"""Refits into live vLLM 0.33 engines on the CPU, checked against vLLM's own loader.

Each case runs a Megatron-Core layout's ranks (reshard.megatron_layout, GPTModel's names) and a vLLM
engine's ranks (one process each, vLLM's own model classes built by vLLM's loader, its layout traced
through vLLM's load_weights) as separate processes meeting at a TCPStore; UCX on loopback moves the
data. After the refit every vLLM parameter must equal, bit for bit, vLLM's own load_weights of the same
checkpoint; the bytes moved must be exactly the elements the vLLM ranks hold (no full tensors, no
padding); the preset for this vLLM release must place every slot as the trace does; a missing,
renamed, reshaped or retyped parameter must fail naming it. Needs the engines venv
(scripts/engine_tests.sh).
"""
import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import reshard  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "refit_worker.py"
def megatron_python() -> str:
    """The live Megatron ranks' Python: this one (the engines venv holds vLLM and Megatron-Core alike)."""
    if importlib.util.find_spec("megatron.core") is None:
        pytest.skip("Megatron-Core does not import here (scripts/venvs.sh engines installs it)")
    return sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_refit(tmp_path, config, train, tp, ep=False, live_megatron=False, bridge=False, timeout=420, fail_trace=-1,
              plant_expert_swap=False, fp8=False):
    """train: a Megatron spec (reshard.megatron_layout's ranks: live GPTModel ranks with live_megatron,
    else buffers the contract oracle fills), "fsdp:N" (N FSDP2 ranks) or "whole" (one rank holding the
    whole checkpoint). fail_trace: that vLLM rank's trace fails, and only the vLLM ranks run.
    plant_expert_swap: the layout swaps local experts 0 and 1, and only the training ranks run."""
    S = int(train.split(":")[1]) if train.startswith("fsdp:") else 1 if train == "whole" else \
        len(reshard.megatron_layout(config, train).ranks)
    store_port, vllm_port, train_port = free_port(), free_port(), free_port()
    store = torch.distributed.TCPStore("127.0.0.1", store_port, None, True, wait_for_workers=False)
    procs = []
    common = ["--config", str(config), "--train", train, "--tp", str(tp), "--store-port", str(store_port),
              "--first-rank", str(S)]
    if ep:
        common.append("--ep")
    if bridge:
        common.append("--bridge")
    if fail_trace >= 0:
        common += ["--fail-trace", str(fail_trace)]
    if plant_expert_swap:
        common.append("--plant-expert-swap")
    if fp8:
        common.append("--fp8")
    env0 = dict(os.environ, UCX_TLS="tcp,self,sm", UCX_NET_DEVICES="lo", GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS="1")
    ranks = range(S, S + tp) if fail_trace >= 0 else range(S) if plant_expert_swap else range(S + tp)
    for r in ranks:
        role = ("vllm" if r >= S else "fsdp" if train.startswith("fsdp") else "whole" if train == "whole" else
                "megatron" if live_megatron else "source")
        env = dict(env0)
        python = megatron_python() if role == "megatron" else sys.executable
        if role in ("fsdp", "megatron"):
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(train_port), RANK=str(r), WORLD_SIZE=str(S),
                       LOCAL_RANK=str(r))
        if role == "vllm":
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(vllm_port), RANK=str(r - S), WORLD_SIZE=str(tp),
                       LOCAL_RANK=str(r - S))
        out = tmp_path / f"rank{r}.json"
        log = open(tmp_path / f"rank{r}.log", "w")
        procs.append((r, out, subprocess.Popen(
            [python, str(WORKER), role, "--rank", str(r), "--work", str(tmp_path / f"work{r}"),
             "--out", str(out)] + common, env=env, stdout=log, stderr=subprocess.STDOUT)))
    deadline = time.monotonic() + timeout
    results = {}
    try:
        for r, out, p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
            assert out.exists(), f"rank {r} wrote no result (exit {p.returncode}); log:\n" + \
                (tmp_path / f"rank{r}.log").read_text()[-3000:]
            results[r] = json.loads(out.read_text())
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
        del store
    if fail_trace >= 0 or plant_expert_swap:
        return [results[r] for r in ranks]
    for r, res in results.items():
        assert res.get("ok"), f"rank {r} ({res['role']}): {res.get('error') or res.get('mismatches')}"
    return [results[r] for r in range(S, S + tp)], [results[r] for r in range(S)]


def check_vllm_ranks(vllm_ranks, planted_kinds=("missing", "renamed", "reshaped", "retyped")):
    for v in vllm_ranks:
        # Every byte this vLLM rank holds comes over the network exactly once: no full tensors, no padding.
        got, needed = v["report"]["bytes_received"], v["needed_bytes"]
        assert got == needed, f"rank {v['rank']} received {got} B; it holds {needed} B of the checkpoint"
        assert v["untraced"] == {}, f"parameters left to another path: {v['untraced']}"
        assert v["mismatches"] == []
        # MLA: W_UK_T / W_UV (views of kv_b_proj in BF16, refreshed copies in FP8) as vLLM derives them.
        assert v.get("derived", {}).get("differ", []) == [], v["derived"]
        pre = v["preset"]
        for kind in planted_kinds if pre is not None else ():
            msg = pre["errors"][kind]
            assert msg is not None, f"a {kind} parameter was accepted"
            assert f"'{pre['planted']}'" in msg, f"{kind}: the error does not name '{pre['planted']}': {msg}"
    return sum(v["report"]["bytes_received"] for v in vllm_ranks)


# The refits check_vllm_ranks checks alone: (checkpoint config, source layout, vLLM tp, run_refit's options).
# (Llama tp=2 from a Megatron layout: the Megatron RL loop case of test_vllm_backend.py refits it from tp=2 x
# pp=2 through the backend, and test_trace.py holds vLLM tp=2's trace against the preset.)
REFITS = {
    "qwen3_moe_tp2_from_megatron_layout_ep2": ("tiny-qwen3-moe.json", "tp=1,dp=2,ep=2", 2, {}),
    # Local expert indices on each EP rank (local_experts.0 is expert 0 on one rank, 4 on the other).
    # Megatron-Bridge 0.6's load_hf_weights fails on this SequentialMLP model ("'NoneType' object has
    # no attribute 'megatron_module'": a parameter without a conversion task), so each routed expert is
    # loaded by Megatron-Core's own placement (MoELayer.local_expert_indices) and checked against
    # reshard.megatron_layout; the oracle writes the other parameters through the model's own names.
    "qwen3_moe_tp2_expert_parallel_from_live_megatron_tp2_ep2":
        ("tiny-qwen3-moe.json", "tp=2,ep=2,etp=1", 2, dict(ep=True, live_megatron=True)),
}


@pytest.mark.parametrize("case", REFITS)
def test_refit(tmp_path, models, case):
    config, train, tp, options = REFITS[case]
    v, _ = run_refit(tmp_path, models / config, train, tp=tp, **options)
    check_vllm_ranks(v)


def test_deepseek_mla_moe_tp2_from_megatron_layout_tp2_ep2(tmp_path, models):
    # tiny-moe: DeepSeek-V3 style (MLA with q_lora, a dense first layer, routed and shared experts,
    # e_score_correction_bias), as vLLM's DeepseekV3ForCausalLM builds it on the CPU, MLA post-processed as
    # after a load: its W_UK_T / W_UV are views of kv_b_proj and follow the refit (8 per rank checked).
    v, _ = run_refit(tmp_path, models / "tiny-moe.json", "tp=2,ep=2,etp=1", tp=2)
    check_vllm_ranks(v)
    assert all(r["derived"] == {"compared": 8, "differ": []} for r in v), [r["derived"] for r in v]


def test_deepseek_mla_moe_in_block_fp8_tp2_expert_parallel_from_megatron_layout_tp2_ep2(tmp_path, models):
    # DeepSeek-V3 style (MLA + MoE) served in block FP8 (every projection's shards whole 128-row tiles:
    # tiny-moe-fp8.json), quantized in flight from a Megatron layout's BF16: each vLLM parameter equals vLLM's
    # load_weights of the reference FP8 checkpoint, each rank received exactly its share of that checkpoint
    # (FP8 weights, scales, the BF16 rest), and after the refit's refresh each MLA layer's W_UK_T / W_UV
    # (dequantized copies of the FP8 kv_b_proj) equal what vLLM's own post-processing derives in the twin.
    # Where vLLM has an FP8 MoE kernel (a GPU) the experts are re-laid for it: withdrawn the CPU's allowance,
    # the FP8 setup refuses them, naming each MoE layer (never silently).
    v, _ = run_refit(tmp_path, models / "tiny-moe-fp8.json", "tp=2,ep=2,etp=1", tp=2, ep=True, fp8=True)
    check_vllm_ranks(v)
    assert all(r["derived"] == {"compared": 8, "differ": []} for r in v), [r["derived"] for r in v]
    for r in v:
        assert [x.split(":")[0] for x in r["refused_with_moe_kernel"]] == \
            [f"model.layers.{i}.mlp.experts.routed_experts" for i in (1, 2, 3)], r["refused_with_moe_kernel"]


def test_llama_kv_heads_replicated_tp4_from_live_megatron_tp2_pp2(tmp_path, models):
    # tiny-llama: 2 kv heads over tp=4 (each replicated twice); vocabulary 1000 padded to 1024 by vLLM;
    # the live GPTModel numbers its layers per stage (decoder.layers.0 on both stages); Megatron-Bridge
    # loads the checkpoint into it, and its result must equal what reshard.megatron_layout says.
    v, t = run_refit(tmp_path, models / "tiny-llama.json", "tp=2,pp=2", tp=4, live_megatron=True, bridge=True)
    check_vllm_ranks(v)
    assert all(x["report"]["parameters"] > 0 for x in t)


def test_a_wrong_local_expert_index_in_the_megatron_layout_fails_on_the_megatron_side(tmp_path, models):
    # Planted: the layout swaps local experts 0 and 1. Filled from that layout (before 2026-12-07) the model
    # agreed with it; loaded by Megatron's own expert placement it differs, and every training rank names
    # the swapped buffers.
    t = run_refit(tmp_path, models / "tiny-qwen3-moe.json", "tp=2,ep=2,etp=1", tp=2, ep=True, live_megatron=True,
                  plant_expert_swap=True, timeout=300)
    for x in t:
        assert not x["ok"] and "differs from reshard.megatron_layout" in x["error"], x
        assert ".mlp.experts.local_experts.0.linear_fc1.weight" in x["error"], x["error"]


def test_llama_tp2_from_fsdp2(tmp_path, models):
    # Two FSDP2 ranks (fully_shard on gloo) of a HuggingFace Llama: the layout read from the DTensors.
    v, t = run_refit(tmp_path, models / "tiny-llama.json", "fsdp:2", tp=2)
    check_vllm_ranks(v)
    assert sum(x["report"]["bytes_sent"] for x in t) == sum(x["needed_bytes"] for x in v)


def test_fused_checkpoint_tp2_from_whole_tensors(tmp_path, models):
    # Phi-3's checkpoint fuses qkv_proj and gate_up_proj: each vLLM rank holds row ranges of them
    # ([q_r; k_r; v_r]). The trace names each range a tensor (rows_of), the source's whole tensors are split
    # to match (reshard.engines.rows.split_rows), nothing is left untraced, and every parameter equals vLLM's
    # own load_weights bit for bit. (GLM-4, whose checkpoint fuses gate_up_proj only, was a second case
    # until 2026-12-08, dropped for .ci/run's time: test_trace.py still traces its row ranges.)
    v, t = run_refit(tmp_path, models / "tiny-phi3.json", "whole", tp=2)
    check_vllm_ranks(v, planted_kinds=())
    assert sum(x["report"]["bytes_sent"] for x in t) == sum(x["needed_bytes"] for x in v)


def test_a_rank_whose_trace_fails_fails_every_rank_at_once_naming_it(tmp_path, models):
    # vLLM rank 1's loader raises; rank 0 learns it at the exchange of the ranks' parts (it does not wait
    # for a part that never comes) and raises the same error, naming global rank 2 (first rank 1 + 1).
    v = run_refit(tmp_path, models / "tiny-llama.json", "whole", tp=2, fail_trace=1, timeout=240)
    for x in v:
        assert not x["ok"] and x.get("kind") == "trace", x
        assert "rank 2: trace: the model's load_weights failed" in x["error"], x["error"]
        assert "planted" in x["error"], x["error"]
        assert x["seconds"] < 30, f"rank {x['rank']} took {x['seconds']:.1f} s to fail"
