"""vLLM's post-processing of a DeepSeek-V3-style model (MLA + MoE) and refits (reshard.engines.fp8): the
model built on this CPU by vLLM's own loader, one process (fp8_worker.py).

(The FP8 refits themselves: the RL loop in test_vllm_backend.py, DeepSeek-V3 style in test_vllm_live.py.)
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


def test_fp8_moe_experts_re_laid_for_a_kernel_are_refused_naming_each_layer(tmp_path, models):
    # As built here (no FP8 MoE kernel on this CPU) the model keeps its checkpoint layout everywhere and
    # nothing is refused. Where vLLM has an FP8 MoE kernel (a GPU), its post-processing re-lays the experts
    # (shuffled, padded) into a layout a refit does not write: the FP8 setup refuses, naming each MoE layer
    # and its backend, never silently.
    out = worker(tmp_path, models, "fp8")
    assert out["kept"] == [], out["kept"]
    refused = out["refused"]
    assert refused and "3 FP8 modules" in refused, refused
    for layer in range(1, 4):
        assert f"model.layers.{layer}.mlp.experts.routed_experts: FP8 MoE experts, backend" in refused, refused


def test_bf16_mla_w_uk_t_and_w_uv_are_views_of_kv_b_proj_and_follow_its_refit(tmp_path, models):
    # In BF16, MLA's W_UK_T / W_UV are views of kv_b_proj's weight: a refit into kv_b_proj reaches them,
    # nothing to redo (checked here against kv_b_proj's rows per head after a write into it).
    out = worker(tmp_path, models, "bf16")
    assert len(out["mla"]) == 4, out
    assert all(m["views"] == [True, True] and m["follows"] for m in out["mla"]), out
