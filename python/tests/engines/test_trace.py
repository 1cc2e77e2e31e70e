"""vLLM's loaders traced by recording maps between views (reshard.engines.record), checked against the
element-tag trace (every checkpoint element fed as a float64 tag: the reference, written before the
recorder and independent of it), against reshard's vLLM preset, and on checkpoints that fuse tensors.

Each engine is traced in this one process (reshard.engines.vllm.traced_layout: vLLM's parallel state
for each rank in turn over fake process groups). Needs the engines venv (scripts/engine_tests.sh).
"""
import json
import subprocess
import sys

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

import reshard  # noqa: E402
from reshard.engines import vllm as rv  # noqa: E402

# Every model and parallel spec the engine tests trace live (test_vllm_live.py, test_vllm_backend.py).
TRACED = [("tiny-llama.json", "tp=2"), ("tiny-llama.json", "tp=4"), ("tiny-llama.json", "tp=2,pp=2"),
          ("tiny-qwen3.json", "tp=2"), ("tiny-qwen3-moe.json", "tp=2"), ("tiny-qwen3-moe.json", "tp=2,ep=2"),
          ("tiny-moe.json", "tp=2"), ("tiny-moe.json", "tp=2,ep=2"), ("tiny-mla-mtp.json", "tp=2")]


def layout_doc(layout):
    """A layout's JSON with its tensors and buffers in name order (the file's order means nothing) and
    no stage coordinate on an axis of size 1 (it says nothing)."""
    doc = json.loads(layout.to_json())
    sizes = dict(doc["mesh"]["axes"])
    for t in doc["tensors"]:
        stage = {a: c for a, c in t.pop("stage", {}).items() if sizes[a] > 1}
        if stage:
            t["stage"] = stage
    doc["tensors"].sort(key=lambda t: t["name"])
    doc["buffers"].sort(key=lambda b: b["name"])
    return doc


@pytest.mark.parametrize("config,spec", TRACED)
def test_recorded_trace_equals_element_tag_trace(tmp_path, models, config, spec):
    tags = rv.traced_layout(models / config, spec, work=tmp_path / "tags", device="cpu", tracer=rv.trace_rank_tags)
    recorded = rv.traced_layout(models / config, spec, work=tmp_path / "rec", device="cpu")
    assert recorded.untraced == tags.untraced == {}
    assert layout_doc(recorded.layout) == layout_doc(tags.layout)
    assert recorded.slow == {}, f"parameters read element by element: {recorded.slow}"


def by_name(buffers):
    return sorted(buffers, key=lambda b: b["name"])


def plan_summary(src, dst):
    s = reshard.plan(src, dst).stats
    return {k: s[k] for k in ("bytes", "local_bytes", "copies", "max_send_bytes", "max_recv_bytes")}


@pytest.mark.parametrize("config,spec", TRACED)
def test_traced_layout_without_storage_equals_the_preset(tmp_path, models, config, spec):
    traced = rv.traced_layout(models / config, spec, work=tmp_path)
    assert traced.untraced == {}
    preset = reshard.vllm_layout(models / config, spec)
    assert traced.layout.ranks == preset.ranks
    for r in preset.ranks:
        assert by_name(traced.layout.buffers(r)) == by_name(preset.buffers(r)), f"rank {r}"
        for b in preset.buffers(r):
            assert traced.layout.slot_runs(r, b["name"]) == preset.slot_runs(r, b["name"]), f"rank {r} {b['name']}"
    src = reshard.megatron_layout(models / config, "tp=2")
    assert plan_summary(src, traced.layout) == plan_summary(src, preset)


def test_trace_command_writes_the_layout(tmp_path, models):
    out = tmp_path / "infer.json"
    p = subprocess.run([sys.executable, "-m", "reshard.engines.vllm", "trace", str(models / "tiny-llama.json"),
                        "--infer", "tp=2", "-o", str(out), "--first-rank", "4"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    layout = reshard.read_layout(out)
    assert layout.ranks == [4, 5]
    assert layout_doc(layout) == layout_doc(reshard.vllm_layout(models / "tiny-llama.json", "tp=2", first_rank=4))
    bad = subprocess.run([sys.executable, "-m", "reshard.engines.vllm", "trace", str(models / "tiny-llama.json"),
                          "--infer", "tp=2,dp=2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "dp=2" in bad.stderr


@pytest.mark.parametrize("config,fused", [("tiny-phi3.json", ["qkv_proj", "gate_up_proj"]),
                                          ("tiny-glm4.json", ["gate_up_proj"])])
def test_fused_checkpoint_tensors_become_row_ranges(tmp_path, models, config, fused):
    traced = rv.traced_layout(models / config, "tp=2", work=tmp_path)
    assert traced.untraced == {}
    doc = layout_doc(traced.layout)
    ranged = {t["name"]: t["rows_of"] for t in doc["tensors"] if "rows_of" in t}
    for kind in fused:
        base = f"model.layers.0.{'self_attn' if kind == 'qkv_proj' else 'mlp'}.{kind}.weight"
        mine = sorted((r["start"], n) for n, r in ranged.items() if r["tensor"] == base)
        assert len(mine) == (3 if kind == "qkv_proj" else 2), f"{base}: {mine}"
    # The element-tag trace cannot say it: its reader takes a tensor's elements in one box per parameter.
    tags = rv.traced_layout(models / config, "tp=2", work=tmp_path / "tags", device="cpu",
                            tracer=rv.trace_rank_tags)
    assert any("qkv_proj" in n or "gate_up_proj" in n for n in tags.untraced)


def test_fused_expert_checkpoints_half_an_expert_at_a_time(tmp_path, models):
    # transformers 5 keeps a MoE layer's experts fused ([E, 2I, H] gate_up_proj, as FSDP2 trainers hold
    # them); vLLM loads each expert's gate and up halves apart. The halves join into one box per expert,
    # then one per layer: nothing untraced, the same layout as the element-tag trace.
    from reshard.engines.vllm_meta import _transformers_tensors

    ckpt = _transformers_tensors(models / "tiny-qwen3-moe.json")
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _, _ in ckpt)
    kw = dict(device="cpu", checkpoint=ckpt)
    recorded = rv.traced_layout(models / "tiny-qwen3-moe.json", "tp=2,ep=2", work=tmp_path / "rec", **kw)
    tags = rv.traced_layout(models / "tiny-qwen3-moe.json", "tp=2,ep=2", work=tmp_path / "tags",
                            tracer=rv.trace_rank_tags, **kw)
    assert recorded.untraced == tags.untraced == {}
    assert layout_doc(recorded.layout) == layout_doc(tags.layout)


def test_a_layout_that_does_not_reproduce_the_loader_fails_naming_the_rank(tmp_path, models):
    # assemble.verify_traces, which both the in-process trace and live_layout run: the layout comes from the
    # rank's pieces; rank 1's recorded writes say one run starts one element later, so they must disagree.
    def tracer(model, checkpoint, coords, load=None):
        t = rv.trace_rank(model, checkpoint, coords, load)
        if coords["tp"] == 1:
            p = t.params[0]
            k = int(np.flatnonzero(p.runs[:, 2] >= 0)[0])
            p.runs = p.runs.copy()
            p.runs[k, 3] += 1
        return t

    with pytest.raises(reshard.Error, match=r"^rank 1: the traced layout does not reproduce vLLM's loader on "
                                            r"parameter '.*': from slot \d+ the layout says"):
        rv.traced_layout(models / "tiny-llama.json", "tp=2", work=tmp_path, device="cpu", tracer=tracer)
