"""reshard as a vLLM weight-transfer backend, driven only through vLLM's own API.

Two FSDP2 trainer ranks (gloo) take SGD steps on a HuggingFace Llama and call the trainer engine that
WeightTransferTrainerFactory builds from ReshardTrainerInitInfo (source: vLLM's ModuleSource); two vLLM
ranks (live models, the CPU recipe) hold the engine WeightTransferEngineFactory builds for
WeightTransferConfig(backend="reshard"), driven through its four phases by the trainer's client. After
every step each vLLM parameter equals, bit for bit, vLLM's own load_weights of the trainer's full state
dict, and each vLLM rank received exactly the bytes of the checkpoint elements it holds. A trainer rank
killed mid-loop fails the update on every other process, naming it, and the version is not published.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "backend_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loop(tmp_path, config, steps, kill_at=0, timeout=420):
    store_port, backend_port, train_port, vllm_port = free_port(), free_port(), free_port(), free_port()
    store = torch.distributed.TCPStore("127.0.0.1", store_port, None, True, wait_for_workers=False)
    env0 = dict(os.environ, UCX_TLS="tcp,self,sm", UCX_NET_DEVICES="lo", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    tw = tmp_path / "trainer"
    tw.mkdir()
    procs = []
    for role, r in [("trainer", 0), ("trainer", 1), ("vllm", 0), ("vllm", 1)]:
        env = dict(env0, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(train_port if role == "trainer" else vllm_port),
                   RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r))
        out = tmp_path / f"{role}{r}.json"
        log = open(tmp_path / f"{role}{r}.log", "w")
        procs.append((f"{role}{r}", out, subprocess.Popen(
            [sys.executable, str(WORKER), role, "--rank", str(r), "--config", str(config), "--steps", str(steps),
             "--kill-at", str(kill_at), "--store-port", str(store_port), "--backend-port", str(backend_port),
             "--work", str(tw if role == "trainer" else tmp_path / f"vllm{r}"), "--trainer-work", str(tw),
             "--out", str(out)], env=env, stdout=log, stderr=subprocess.STDOUT)))
    deadline = time.monotonic() + timeout
    results, ended = {}, {}
    try:
        for name, out, p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
            ended[name] = time.monotonic()
            results[name] = json.loads(out.read_text()) if out.exists() else {"ok": False, "exit": p.returncode}
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
        del store
    return results


def test_rl_loop_through_vllm_weight_transfer_api(tmp_path, models):
    res = run_loop(tmp_path, models / "tiny-llama.json", steps=3)
    for name, r in res.items():
        assert r.get("ok"), f"{name}: {r.get('error')}\n" + (tmp_path / f"{name}.log").read_text()[-3000:]
    for r in (res["vllm0"], res["vllm1"]):
        assert r["engine"] == "ReshardWeightTransferEngine"
        assert [c["version"] for c in r["checked"]] == [1, 2, 3]
        for c in r["checked"]:  # only the bytes this rank holds: no full tensors
            assert c["received"] == c["held"], c
    assert len(res["trainer0"]["steps"]) == 3


def test_killed_trainer_rank_fails_the_update_and_it_is_not_published(tmp_path, models):
    res = run_loop(tmp_path, models / "tiny-llama.json", steps=3, kill_at=2)
    t0 = res["trainer0"]
    assert t0.get("ok"), t0.get("error")
    assert t0["failed_step"] == 2 and "rank 1" in t0["error"], t0["error"]
    assert "not published" in t0["finish_error"], t0.get("finish_error")
    assert not t0.get("published_after_failure")
    for r in (res["vllm0"], res["vllm1"]):
        assert r.get("ok"), r.get("error")
        assert r["version"] == 1, f"a failed update was published: version {r['version']}"
        assert r["failed"] and "version 2" in r["failed"]
