"""reshard.engines.megatron.MegatronSource: a live GPTModel bound in place to reshard.megatron_layout, and
refused, naming the parameters, where the model holds parameters the layout does not give the rank (they
would never be refit). One Megatron rank in a process of its own (Megatron-Core's state is global)."""
import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

SCRIPT = r"""
import json, sys
import reshard
from reshard.engines.megatron import MegatronSource, build
config, arch, spec = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = json.load(open(config))
cfg["architectures"] = [arch]
model = build(cfg, spec, seed=0)
source = MegatronSource(model, config, spec)
try:
    bound = source.buffers(0)
    print(json.dumps({"bound": sorted(bound), "params": sum(1 for _ in model.parameters()),
                      "in_place": all(bound[n].data_ptr() == p.data_ptr() for n, p in source.iter_local())}))
except reshard.Error as e:
    print(json.dumps({"error": str(e)}))
"""


def bind(config, arch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(config), arch, "tp=1"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip(), p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_gptmodel_binds_every_parameter_in_place(models):
    out = bind(models / "tiny-llama.json", "LlamaForCausalLM")
    assert "error" not in out, out["error"]
    assert len(out["bound"]) == out["params"] and out["in_place"], out
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in out["bound"]


def test_a_gptmodel_with_parameters_the_layout_does_not_give_is_refused_naming_them(models):
    # Built as a Qwen3 (q and k layernorms), laid out by a Llama config of the same sizes: every buffer of
    # the layout binds, and the layernorms would never be refit.
    out = bind(models / "tiny-llama.json", "Qwen3ForCausalLM")
    assert "error" in out, out
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in out["error"], out["error"]
    assert "no refit would send them" in out["error"], out["error"]
