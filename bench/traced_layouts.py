"""Traced vLLM layouts of real configs at their serving parallelism, against reshard's vLLM preset.

For each case, in a process of its own (its peak memory is its own):
``reshard.engines.vllm.traced_layout(config, spec)`` (every rank of the engine
traced through vLLM's own model classes and loaders on the meta device), its
seconds and peak resident memory; then, against ``reshard.vllm_layout(config,
spec)``: the same buffers on every rank (names, shapes, dtypes, tensors) and
the same plan from a Megatron source (bytes, local bytes, copies, per-rank send
and receive maxima). One JSON line per case on stdout (``--out`` appends them
to a file too), then a markdown table.

Kimi-K2 also gets the production refit: 256 Megatron ranks to 8 engines of 16
(128 inference ranks), the engines' layout traced (one engine, replicated:
each data-parallel replica is an engine of its own) and written with the
source so ``reshard-plan --simulate`` plans and simulates it
(``--emit DIR``).

    python bench/traced_layouts.py [--cases NAME,...] [--out FILE] [--emit DIR]

Needs the engines venv (scripts/venvs.sh engines) with reshard installed.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
MODELS = REPO / "examples" / "models"

# name: (config, vLLM spec, Megatron spec of the plan's source)
CASES = {
    "llama-3.1-8b-tp1": ("llama-3.1-8b.json", "tp=1", "tp=2"),
    "llama-3.1-8b-tp8": ("llama-3.1-8b.json", "tp=8", "tp=2,pp=2"),
    "llama-3.1-70b-tp8": ("llama-3.1-70b.json", "tp=8", "tp=8,pp=4"),
    "qwen3-30b-a3b-tp4-ep4": ("qwen3-30b-a3b.json", "tp=4,ep=4", "tp=2,ep=4,etp=1,dp=2"),
    "qwen3-235b-a22b-tp8-ep8": ("qwen3-235b-a22b.json", "tp=8,ep=8", "tp=4,pp=4,ep=8,etp=1,dp=2"),
    "deepseek-v3-tp8-ep8": ("deepseek-v3.json", "tp=8,ep=8", "tp=1,pp=8,dp=32,ep=32"),
    "kimi-k2-tp16-ep16": ("kimi-k2.json", "tp=16,ep=16", "tp=1,pp=8,dp=32,ep=32"),
}

CHILD = r"""
import json, logging, resource, sys, time
logging.basicConfig(level=logging.WARNING)
config, spec, out = sys.argv[1:4]
from reshard.engines.vllm import traced_layout
t = traced_layout(config, spec)
open(out, "w").write(t.to_json())
print(json.dumps({"seconds": t.seconds, "build_seconds": t.build_seconds, "trace_seconds": t.trace_seconds,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                  "untraced": t.untraced, "slow": t.slow}))
"""


def trace(config: pathlib.Path, spec: str, out: pathlib.Path) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, str(config), spec, str(out)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"traced_layout({config.name}, {spec}) failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def plan_summary(src, dst) -> dict:
    import reshard

    s = reshard.plan(src, dst).stats
    return {k: s[k] for k in ("bytes", "local_bytes", "copies", "max_send_bytes", "max_recv_bytes")}


def named_runs(layout, rank: int) -> dict:
    """Each buffer's slot runs with the tensor as its name (two layouts may order their tensors apart)."""
    import numpy as np

    names = np.array(list(layout.tensors) + [""], dtype=object)
    return {b: [tuple(r) for r in zip(runs[:, 0].tolist(), runs[:, 1].tolist(), names[runs[:, 2]].tolist(),
                                       runs[:, 3].tolist())]
            for b, runs in layout.slot_runs(rank, columns=True).items()}


def compare(traced, preset, src) -> dict:
    """Where the traced layout and the preset differ: buffers per rank, every slot of them, then the plan
    from ``src``."""
    if traced.ranks != preset.ranks:
        return {"equal": False, "why": f"ranks {traced.ranks[:4]}... against {preset.ranks[:4]}..."}
    for r in preset.ranks:
        a, b = (sorted(x.buffers(r), key=lambda b: b["name"]) for x in (traced, preset))
        if a != b:
            names = {x["name"] for x in a} ^ {x["name"] for x in b}
            return {"equal": False, "why": f"rank {r}: buffers differ ({sorted(names)[:4]} or shapes/parts)"}
        ra, rb = named_runs(traced, r), named_runs(preset, r)
        bad = [n for n in rb if ra[n] != rb[n]]
        if bad:
            return {"equal": False, "why": f"rank {r}: slots differ in {len(bad)} buffers ({bad[:3]})"}
    pa, pb = plan_summary(src, traced), plan_summary(src, preset)
    return {"equal": pa == pb, "plan": pa, **({} if pa == pb else {"why": "plans differ", "preset_plan": pb})}


def replicate(layout_json: str, dp: int, first_rank: int) -> str:
    """An engine's layout as ``dp`` engines side by side: its mesh's dp axis of 1 set to ``dp`` (the
    tensors name no dp: every replica holds the same)."""
    doc = json.loads(layout_json)
    axes = doc["mesh"]["axes"]
    assert axes[0] == ["dp", 1], axes
    axes[0] = ["dp", dp]
    doc["mesh"]["first_rank"] = first_rank
    return json.dumps(doc)


def main() -> int:
    import reshard

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated names of: " + ", ".join(CASES))
    ap.add_argument("--out", help="append each case's JSON line here")
    ap.add_argument("--emit", help="write Kimi-K2's 256 -> 128 source and traced destination layouts here")
    ap.add_argument("--work", default="/tmp/reshard-traced-layouts")
    a = ap.parse_args()
    work = pathlib.Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.cases.split(","):
        config, spec, train = CASES[name]
        out = work / f"{name}.json"
        res = trace(MODELS / config, spec, out)
        traced = reshard.read_layout(out)
        src = reshard.megatron_layout(MODELS / config, train)
        res.update(case=name, config=config, spec=spec, train=train,
                   **compare(traced, reshard.vllm_layout(MODELS / config, spec), src))
        print(json.dumps(res), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(res) + "\n")
        rows.append(res)
        if name.startswith("kimi") and a.emit:
            emit = pathlib.Path(a.emit)
            emit.mkdir(parents=True, exist_ok=True)
            src = reshard.megatron_layout(MODELS / config, "tp=1,pp=8,dp=32,ep=32")
            (emit / "src.json").write_text(src.to_json())
            (emit / "dst.json").write_text(replicate(out.read_text(), 8, len(src.ranks)))
    print("\n| model | vLLM spec | trace | peak memory | equals the preset (plan from Megatron " "source) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        eq = "yes" if r["equal"] else f"no: {r.get('why') or 'plans differ'}"
        print(f"| {r['config']} | {r['spec']} | {r['seconds']:.1f} s | {r['peak_rss_gb']:.2f} GB | {eq} "
              f"(`{r['train']}`: {r['plan']['copies'] if 'plan' in r else '-'} copies) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
