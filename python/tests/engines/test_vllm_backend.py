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


def rl_loop(tmp_path, *args, timeout=600, failing=False):
    """The loop's exit code and JSON summary; unless ``failing``, a summary with an error fails the test."""
    env = dict(os.environ, UCX_TLS="tcp,self,sm", UCX_NET_DEVICES="lo", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(LOOP), "--json", *map(str, args)],
                       env=env, capture_output=True, text=True, timeout=timeout)
    lines = p.stdout.strip().splitlines()
    assert lines, f"no output (exit {p.returncode}):\n{p.stderr[-4000:]}"
    try:
        out = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise AssertionError(f"the last line is not the JSON summary:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    assert failing or "error" not in out, out["error"]
    return p.returncode, out


# (A plain bf16 Llama from FSDP2 is the f32 case without its cast; the fault tests below run it too.)
@pytest.mark.parametrize("config,extra", [("tiny-qwen3-moe.json", ["--expert-parallel"]),
                                          ("tiny-llama.json", ["--master-f32"])],
                         ids=["qwen3-moe-tp2-ep", "llama-f32-master-cast-to-bf16"])
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


@pytest.mark.parametrize("config,train,extra", [("tiny-llama.json", "tp=2,pp=2", []),
                                                ("tiny-qwen3-moe.json", "tp=2,ep=2,etp=1", ["--expert-parallel"])],
                         ids=["llama-megatron-tp2-pp2", "qwen3-moe-megatron-tp2-ep2-into-vllm-ep"])
def test_rl_loop_from_a_megatron_core_trainer_through_vllm_weight_transfer_api(tmp_path, models, config, train,
                                                                              extra):
    # Megatron-Core GPTModel trainer actors (real steps over their pipeline stages) bound in place by
    # reshard.megatron_layout (MegatronSource): fused linear_qkv / linear_fc1, stage-local layer numbers,
    # local experts. Checked after every step against vLLM's own load_weights of the checkpoint that
    # reshard.engines.megatron.hf_state exports (Megatron's own attributes, not reshard's layout).
    pytest.importorskip("megatron.core")
    code, out = rl_loop(tmp_path, "--model", models / config, "--trainer", "megatron", "--train", train,
                        "--rollout-tp", 2, "--steps", 3, *extra)
    assert code == 0 and out["validated"] is True and out["steps"] == 3, out
    assert all(r == out["held"] for r in out["received"]), (out["received"], out["held"])
    world = out["trainers"]
    # Every trainer rank sends what it holds (each stage its layers, each expert rank its experts); nothing
    # is gathered: what left the trainers is what the vLLM ranks hold.
    sent = [out["rank_bytes"][str(r)]["sent"] for r in range(world)]
    assert all(b > 0 for b in sent) and sum(sent) == sum(out["held"]), (sent, out["held"])
    assert len(set(out["losses"])) == 3, out["losses"]  # the optimizer stepped
    assert 1.9 < out["bytes_ratio"] <= 2, out["bytes_ratio"]


def test_rl_loop_into_block_fp8_engines_quantized_in_flight(tmp_path, models):
    # vLLM engines serving the model in block FP8 (DeepSeek-V3's quantization_config: e4m3 weights, a
    # weight_scale_inv per 128x128 tile, fused per projection as vLLM holds them; built on this CPU with its
    # kernel selection stubbed, no GEMM runs), refit from FSDP2's BF16 with the quantizing done in flight.
    # Checked after every step against vLLM's own load_weights of the FP8 checkpoint that the reference
    # quantizer (torch ops) makes of the trainer's state, into a twin model.
    code, out = rl_loop(tmp_path, "--model", models / "tiny-llama-fp8.json", "--quantization", "fp8", "--steps", 3)
    assert code == 0 and out["validated"] is True and out["steps"] == 3, out
    # Each vLLM rank received exactly its share of the FP8 checkpoint (counted from what vLLM's loader writes
    # there: FP8 weights, their scales, the BF16 embeddings, norms and lm_head): the trainer's shards are
    # whole tiles, so each sender quantized its tiles and sent FP8 and scales.
    assert all(r == out["held"] for r in out["received"]), (out["received"], out["held"])
    # The peer sends the whole FP8 checkpoint to each of the 2 vLLM ranks.
    assert 1.9 < out["bytes_ratio"] <= 2, out["bytes_ratio"]


def test_planted_faults_a_missed_write_a_scale_an_ulp_off_a_tile_from_wrong_rows_fail_the_check(tmp_path, models):
    # Planted faults in step 2 on vLLM rank 0 of block-FP8 engines: one embed_tokens row keeps what it held
    # before the update, a row that step 2's training did not change (checked in the same model against
    # its own loader, as before 2026-12-07, it would still equal version 2; with the parameters set to junk
    # before each update and a twin model as the reference it shows); one scale entry is one ulp off; one
    # tile holds the FP8 codes of the tile below it. The step fails naming each.
    code, out = rl_loop(tmp_path, "--model", models / "tiny-llama-fp8.json", "--quantization", "fp8", "--steps", 2,
                        "--no-peer", "--plant-missed-write", 2, "--plant-fp8-faults", 2, failing=True)
    assert code != 0 and out["validated"] is False, out
    err = out["error"][-3000:]
    assert "version 2: 3 parameters differ" in err, err
    assert "model.embed_tokens.weight" in err and "never written (junk)" in err, err
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv: 1 of" in err, err
    assert "model.layers.0.self_attn.o_proj.weight: " in err, err


def no_stale_words(text):
    """A failure's words never call written bytes stale or not updated (CONTRACT.md section 5)."""
    return "stale" not in text and "not updated" not in text


def test_killed_rollout_actor_the_survivor_says_what_it_holds_and_a_new_engine_repairs(tmp_path, models):
    code, out = rl_loop(tmp_path, "--model", models / "tiny-llama.json", "--steps", 3, "--kill", "rollout:1@2",
                        "--no-peer", "--recover")
    f = out["failure"]
    assert code == 0 and f["step"] == 2 and f["seconds"] < 30, out
    errors = f["errors"]
    assert errors.pop("rollout 1") == "dead"
    # reshard rank 3 is vLLM rank 1 (two trainer ranks first): every survivor names it, with the legend.
    for who, e in errors.items():
        assert "rank 3" in e and "2-3 vLLM ranks 0-1" in e and no_stale_words(e), f"{who}: {e}"
    assert "rollout actor 1 (vLLM rank 1) died" in errors["trainer 0"]
    assert f["published"] == {"rollout 0": 1}, f  # the failed version 2 was not published
    assert "not published" in f["finish"]["rollout 0"] and no_stale_words(f["finish"]["rollout 0"]), f
    # The survivor's report against its memory, parameter by parameter, element by element.
    held = f["held"]["rollout 0"]
    assert held["misnamed"] == [] and held["written"] + held["partial"] > 0, held
    assert held["written"] + held["partial"] + held["untouched"] == held["parameters"], held
    # A new engine, set up by repair(client), bit for bit after a dense update; then step 3 as usual.
    r = out["recovery"]
    assert r["validated"] and r["mode"] == "dense" and r["kind"].startswith("rollout died"), r
    assert out["steps"] == 2, out  # steps 1 and 3 (each checked bit for bit)


def test_killed_trainer_rank_fails_the_update_and_a_restarted_trainer_repairs(tmp_path, models):
    code, out = rl_loop(tmp_path, "--model", models / "tiny-llama.json", "--steps", 3, "--kill", "trainer:1@2",
                        "--no-peer", "--recover")
    f = out["failure"]
    assert code == 0 and f["step"] == 2 and f["seconds"] < 30 and f["errors"]["trainer 1"] == "dead", out
    for who in ("trainer 0", "rollout 0", "rollout 1"):
        assert "rank 1" in f["errors"][who] and "are trainer ranks 0-1" in f["errors"][who], (who, f["errors"][who])
    assert f["published"] == {"rollout 0": 1, "rollout 1": 1}, f
    assert all("not published" in v for v in f["finish"].values()), f
    r = out["recovery"]
    assert r["validated"] and r["mode"] == "dense" and r["kind"].startswith("trainer died"), r
    assert out["steps"] == 2, out


def test_transient_fault_repaired_in_place_and_a_skipped_finish_refused(tmp_path, models):
    """A rollout rank stalls past stall_timeout in step 2 (it lives on): the update fails everywhere,
    repair() into the same engines brings them back bit for bit; step 3's client skips
    finish_weight_update, and the next update is refused on every trainer rank, naming it."""
    code, out = rl_loop(tmp_path, "--model", models / "tiny-llama.json", "--steps", 3, "--stall", "rollout:1@2",
                        "--recover", "--skip-finish", 3, "--no-peer")
    f = out["failure"]
    assert code == 0 and f["step"] == 2, out
    for who, e in f["errors"].items():
        assert no_stale_words(e), (who, e)
    for who, held in f["held"].items():
        assert held["misnamed"] == [], (who, held)
    r = out["recovery"]
    assert r["validated"] and r["mode"] == "dense" and r["kind"].startswith("transient"), r
    assert out["steps"] == 2, out
    assert set(out["refused"]) == {"trainer 0", "trainer 1"}, out["refused"]
    for who, e in out["refused"].items():
        assert "finish_weight_update" in e and "not finished" in e, (who, e)


def test_transactional_engines_keep_the_last_version_through_a_killed_rank(tmp_path, models):
    """With transactional=True each update lands in a staging copy, copied into the live parameters when it
    is published: a rank killed in step 2's update leaves the survivor's parameters all at version 1."""
    code, out = rl_loop(tmp_path, "--model", models / "tiny-llama.json", "--steps", 2, "--kill", "rollout:1@2",
                        "--no-peer", "--transactional")
    f = out["failure"]
    assert code == 0 and out["steps"] == 1 and f["step"] == 2, out  # step 1 was checked bit for bit
    held = f["held"]["rollout 0"]
    assert held["misnamed"] == [] and held["untouched"] == held["parameters"] > 0, held
    assert "transactional" in f["errors"]["rollout 0"], f["errors"]["rollout 0"]


def test_config_mismatch_fails_every_trainer_rank_at_once_naming_it(tmp_path, models):
    """Rollouts built from a config with one more layer than the trainer's: every trainer rank raises the
    engines' own words within seconds (published on the store), not a store timeout."""
    cfg = json.loads((models / "tiny-llama.json").read_text())
    cfg["num_hidden_layers"] += 1
    other = tmp_path / "five-layers.json"
    other.write_text(json.dumps(cfg))
    code, out = rl_loop(tmp_path, "--model", models / "tiny-llama.json", "--rollout-model", other, "--no-peer")
    fails = out["setup_failure"]
    assert code == 0 and set(fails) == {"trainer 0", "trainer 1"}, out
    for who, r in fails.items():
        assert "configs differ: layers: the trainer's checkpoint has 4, the engine's model 5" in r["error"], (who, r)
        assert "vLLM rank" in r["error"] and r["seconds"] < 10, (who, r)


def test_setup_errors_tell_absent_parameters_from_computed_ones():
    import types

    from reshard.vllm import config_differences, untraced_error

    ckpt = [("model.embed_tokens.weight", [1000, 64]), ("model.layers.0.self_attn.q_proj.weight", [64, 64]),
            ("model.layers.1.mlp.experts.3.up_proj.weight", [8, 64]), ("lm_head.weight", [1000, 64])]
    hf = types.SimpleNamespace(num_hidden_layers=3, vocab_size=1024, num_experts=8)
    diffs = config_differences(ckpt, hf)
    assert diffs == ["layers: the trainer's checkpoint has 2, the engine's model 3",
                     "vocabulary: the trainer's model.embed_tokens.weight has 1000 rows, the engine's model 1024",
                     "experts: the trainer's checkpoint has 1, the engine's model 8"], diffs
    assert config_differences(ckpt, types.SimpleNamespace(num_hidden_layers=2, vocab_size=1000)) == []
    names = [n for n, _ in ckpt]
    absent = untraced_error(["model.layers.2.self_attn.qkv_proj.weight"], names, [])
    assert "lacks these parameters" in absent and "computes" not in absent, absent
    computed = untraced_error(["model.layers.0.self_attn.qkv_proj.weight_scale"], names, [])
    assert "computes these parameters" in computed and "lacks" not in computed, computed


def test_the_docs_rollout_example_runs_as_written(tmp_path, models):
    """docs/vllm.md's rollout-side example, taken from the markdown (so it cannot drift) and run."""
    text = (REPO / "docs" / "vllm.md").read_text()
    marker = "<!-- the rollout example:"
    assert text.count(marker) == 1
    block = text[text.index(marker):]
    code = block[block.index("```python\n") + len("```python\n"):block.index("\n```\n")]
    script = tmp_path / "example.py"
    script.write_text(code + "\n")
    env = dict(os.environ, UCX_TLS="tcp,self,sm", UCX_NET_DEVICES="lo", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script), str(models / "tiny-llama.json")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    # (Ray forwards the actors' log lines to the driver's stdout too, some after the example's own line.)
    lines = [x for x in p.stdout.splitlines() if x.startswith('{"update"')]
    assert len(lines) == 1, p.stdout[-3000:]
    out = json.loads(lines[0])
    assert out["update"]["version"] == 1 and out["update"]["mode"] == "dense" and out["update"]["bytes"] > 0, out
    assert len(out["update"]["rank_bytes"]) == 4, out  # two trainer ranks, two vLLM ranks
    assert out["repair"]["version"] == 2 and out["repair"]["mode"] == "dense", out


class DictStore:
    """The store calls await_engines makes (check, get, set, add) over a dict, thread-safe."""

    def __init__(self):
        import threading
        self.d, self.lock = {}, threading.Lock()

    def check(self, keys):
        with self.lock:
            return all(k in self.d for k in keys)

    def get(self, key):
        with self.lock:
            return self.d[key]

    def set(self, key, value):
        with self.lock:
            self.d[key] = value if isinstance(value, bytes) else str(value).encode()

    def add(self, key, n):
        with self.lock:
            v = int(self.d.get(key, b"0")) + n
            self.d[key] = str(v).encode()
            return v


def test_the_trainer_waits_while_engines_beat_and_names_a_silent_one():
    """A setup slower than the silence bound passes while the engines beat; a rank that stops beating is
    named after the bound; a published setup error is raised as it was published."""
    import threading
    import time

    import reshard
    from reshard.vllm import await_engines, publish_error

    store = DictStore()
    store.set("p/engines", "2")

    def slow_setup(stop_beating_rank=None, publish=True):
        for _ in range(8):  # 1.6 s of setup, beating every 0.2 s
            for r in range(2):
                if r != stop_beating_rank:
                    store.add(f"p/beat/{r}", 1)
            time.sleep(0.2)
        if publish:
            store.set("p/dst_layout", "{layout}")

    t = threading.Thread(target=slow_setup)
    t.start()
    t0 = time.monotonic()
    assert await_engines(store, "p", first_beat=5, silence=0.6) == "{layout}"
    assert time.monotonic() - t0 > 1.2  # it waited past the silence bound: slow is not silent
    t.join()

    store = DictStore()
    store.set("p/engines", "2")
    t = threading.Thread(target=slow_setup, kwargs={"stop_beating_rank": 1, "publish": False})
    t.start()
    with pytest.raises(reshard.Error, match=r"vLLM rank 1 stopped beating for over 1 s"):
        await_engines(store, "p", first_beat=5, silence=0.6)
    t.join()

    store = DictStore()
    publish_error(store, "p/setup_error", "vLLM rank 0: the trainer's checkpoint does not fit this engine's model")
    publish_error(store, "p/setup_error", "a later error")  # the first one stays
    with pytest.raises(reshard.Error, match=r"^vLLM rank 0: the trainer's checkpoint does not fit"):
        await_engines(store, "p", first_beat=5, silence=0.6)
