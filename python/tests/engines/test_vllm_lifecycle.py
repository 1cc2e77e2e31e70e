"""The "reshard" backend across an engine's life (issue 51, item 4): vLLM's sleep and wake-up, parameters
re-allocated between updates, a second init_transfer_engine, the targeted vLLM version, EPLB.

One subprocess (lifecycle_worker.py) holds a live vLLM engine rank (tp=1, CPU recipe) and a trainer rank
whose client calls the engine's phases directly; every refit is compared bit for bit with vLLM's own
load_weights of the trainer's parameters. vLLM's CPU worker ignores sleep ("not supported on CPU"), so
the cases drive the engine's sleep / wake_up hooks, which a deployment calls beside vLLM's (docs/vllm.md).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cases(tmp_path_factory, models):
    work = tmp_path_factory.mktemp("lifecycle")
    env = dict(os.environ, UCX_TLS="tcp,self,sm", UCX_NET_DEVICES="lo", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(HERE / "lifecycle_worker.py"), str(models / "tiny-llama.json"), str(work)],
                       env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    assert p.returncode == 0 and lines, f"exit {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(lines[-1])


def case(cases, name):
    out = cases[name]
    assert "error" not in out, out["error"]
    return out


def test_a_reallocated_parameter_is_refused_by_name_then_rebound_and_refit_into_its_new_storage(cases):
    out = case(cases, "stale_binding")
    name = "model.layers.1.mlp.gate_up_proj.weight"
    assert out["refused"] and name in out["refused"] and "re-allocated" in out["refused"], out["refused"]
    # The trainer set the transfer up again and sent a dense update into the memory the model uses now.
    assert out["re_set_up"] and out["mode"] == "dense" and out["version"] == 2, out
    assert out["new_storage_bound"] and out["differing"] == [], out
    assert out["old_untouched"], "the refit wrote the storage the model no longer uses"
    # A layout that changed (bf16 -> f32) is refused naming the parameter, not re-bound.
    assert out["changed_layout"] and name in out["changed_layout"] and "torch.float32" in out["changed_layout"], out
    assert out["differing_after_restore"] == [], out


def test_an_update_while_asleep_is_refused_and_wake_ups_keep_or_rebind(cases):
    out = case(cases, "sleep")
    for level in (1, 2):
        assert out[f"asleep{level}"] and f"sleep(level={level})" in out[f"asleep{level}"], out
    # Level 1: the weights come back where they were; the bindings are checked and kept (a delta update).
    assert out["level1"]["kept"] and out["level1"]["mode"] not in ("dense", "prime"), out["level1"]
    assert out["level1"]["differing"] == [], out["level1"]
    # Level 2: the weights were discarded: the next update re-binds (a new setup) and writes every element.
    assert not out["level2"]["kept"] and out["level2"]["mode"] in ("dense", "prime"), out["level2"]
    assert out["level2"]["differing"] == [], out["level2"]


def test_reinit_closes_the_old_resharder_and_shutdown_frees_the_store_port(cases):
    out = case(cases, "reinit")
    assert out["old_closed"] and out["new_open"] and out["differing"] == [], out
    assert out["port_free"], "the trainer's store port is still bound after shutdown"


def test_another_vllm_version_is_refused_naming_both(cases):
    out = case(cases, "version")
    for side in ("trainer", "engine"):
        assert out[side] and "0.34.1" in out[side] and "0.33" in out[side], out


def test_eplb_is_refused_naming_the_option(cases):
    out = case(cases, "eplb")
    assert out["enable_eplb"] and "enable_eplb" in out["enable_eplb"], out
