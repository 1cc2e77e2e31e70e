"""Block-FP8 vLLM engines and vLLM's post-processing of MLA (reshard.engines.fp8): a DeepSeek-V3-style model
(MLA + MoE) built on this CPU by vLLM's own loader, one process (fp8_worker.py).

(The FP8 refits themselves run in the RL loop: test_vllm_backend.py.)
"""
import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

WORKER = os.path.join(os.path.dirname(__file__), "fp8_worker.py")


def worker(tmp_path, models, kind):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, WORKER, str(models / "tiny-moe-fp8.json"), str(tmp_path / kind), str(port), kind],
                       env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    assert p.returncode == 0 and lines, f"exit {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(lines[-1])


def test_fp8_mla_whose_post_processing_dequantizes_kv_b_proj_is_refused_naming_each_module(tmp_path, models):
    # In block FP8, vLLM's MLA post-processing keeps dequantized BF16 copies of each FP8 kv_b_proj (W_UK_T,
    # W_UV) that load_weights never writes: a refit that does not redo them would leave them stale, so the
    # FP8 setup refuses, naming each MLA module and the transform (never silently). The MoE experts, which
    # keep their checkpoint layout on the CPU (no FP8 MoE kernel here), and the linear layers pass.
    out = worker(tmp_path, models, "fp8")
    refused = out["refused"]
    assert refused and "4 FP8 modules" in refused, refused
    for layer in range(4):
        assert f"model.layers.{layer}.self_attn.mla_attn.mla_attn: MLA's W_UK_T / W_UV" in refused, refused
    assert "experts" not in refused and "kernel" not in refused, refused


def test_bf16_mla_w_uk_t_and_w_uv_are_views_of_kv_b_proj_and_follow_its_refit(tmp_path, models):
    # In BF16, MLA's W_UK_T / W_UV are views of kv_b_proj's weight: a refit into kv_b_proj reaches them,
    # nothing to redo (checked here against kv_b_proj's rows per head after a write into it).
    out = worker(tmp_path, models, "bf16")
    assert len(out["mla"]) == 4, out
    assert all(m["views"] == [True, True] and m["follows"] for m in out["mla"]), out
