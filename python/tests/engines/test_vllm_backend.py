"""reshard as a vLLM weight-transfer backend, driven only through vLLM's own API, in the RL loop on Ray.

Each case runs examples/python/vllm_rl_loop.py (short): FSDP2 trainer actors (gloo) take optimizer steps
and call the trainer engine WeightTransferTrainerFactory builds; rollout actors hold live vLLM models
(the CPU recipe) and the engine WeightTransferEngineFactory builds for backend="reshard", driven
through its four phases. The example compares, after every step, every vLLM parameter bit for bit with
vLLM's own load_weights of the trainer's full state dict; the test reads its --json line and checks
that, the bytes each vLLM rank received (exactly those of the checkpoint elements it holds: no full
tensors), and what a killed actor does to the others.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

REPO = pathlib.Path(__file__).resolve().parents[3]
LOOP = REPO / "examples" / "python" / "vllm_rl_loop.py"


def rl_loop(tmp_path, *args, timeout=600):
    env = dict(os.environ, UCX_TLS="tcp,self,sm", UCX_NET_DEVICES="lo", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(LOOP), "--json", *map(str, args)],
                       env=env, capture_output=True, text=True, timeout=timeout)
    lines = p.stdout.strip().splitlines()
    assert lines, f"no output (exit {p.returncode}):\n{p.stderr[-4000:]}"
    try:
        out = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise AssertionError(f"the last line is not the JSON summary:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    assert "error" not in out, out["error"]
    return p.returncode, out


@pytest.mark.parametrize("config,extra", [("tiny-llama.json", []),
                                          ("tiny-qwen3-moe.json", ["--expert-parallel"]),
                                          ("tiny-llama.json", ["--master-f32"])],
                         ids=["llama-tp2", "qwen3-moe-tp2-ep", "llama-f32-master-cast-to-bf16"])
def test_rl_loop_through_vllm_weight_transfer_api(tmp_path, models, config, extra):
    code, out = rl_loop(tmp_path, "--model", models / config, "--steps", 3, *extra)
    assert code == 0 and out["validated"] is True and out["steps"] == 3, out
    # Only the bytes each vLLM rank holds arrived there: no full tensors, nothing twice.
    assert all(r == out["held"] for r in out["received"]), (out["received"], out["held"])
    assert all(s > 0 for s in out["update_seconds"]) and out["seconds"] > 0
    # The peer (broadcast + load_weights) delivers the full model, in the trainer's dtype, to each of the 2
    # vLLM ranks; the backend each rank its shard in vLLM's bf16 (norms are replicated: a little more than
    # half), so 2x fewer bytes, 4x from an f32 master.
    assert out["peer_seconds"] > 0 and len(set(out["peer_bytes"])) == 1
    want = 4 if "--master-f32" in extra else 2
    assert 0.95 * want < out["bytes_ratio"] <= want, out["bytes_ratio"]


def test_killed_rollout_actor_fails_the_step_everywhere_naming_it(tmp_path, models):
    code, out = rl_loop(tmp_path, "--model", models / "tiny-llama.json", "--steps", 3, "--kill", "rollout:1@2",
                        "--no-peer")
    assert code == 0 and out["steps"] == 1 and out["validated"] is False, out
    f = out["failure"]
    assert f["step"] == 2 and f["seconds"] < 30, f
    errors = f["errors"]
    assert errors.pop("rollout 1") == "dead"
    # reshard rank 3 is vLLM rank 1 (two trainer ranks first): every survivor names it, with the legend.
    for who, e in errors.items():
        assert "rank 3" in e and "2-3 vLLM ranks 0-1" in e, f"{who}: {e}"
    assert "rollout actor 1 (vLLM rank 1) died" in errors["trainer 0"]
    assert f["published"] == {"rollout 0": 1}, f  # the failed version 2 was not published
    assert "not published" in f["finish"]["rollout 0"], f


def test_killed_trainer_rank_fails_the_update_and_it_is_not_published(tmp_path, models):
    code, out = rl_loop(tmp_path, "--model", models / "tiny-llama.json", "--steps", 3, "--kill", "trainer:1@2",
                        "--no-peer")
    assert code == 0 and out["steps"] == 1, out
    f = out["failure"]
    assert f["step"] == 2 and f["seconds"] < 30 and f["errors"]["trainer 1"] == "dead", f
    for who in ("trainer 0", "rollout 0", "rollout 1"):
        assert "rank 1" in f["errors"][who] and "are trainer ranks 0-1" in f["errors"][who], (who, f["errors"][who])
    assert f["published"] == {"rollout 0": 1, "rollout 1": 1}, f
    assert all("not published" in v for v in f["finish"].values()), f
