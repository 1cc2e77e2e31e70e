"""Plans from Python are reshard-plan's (the same C++): --json byte for byte, --stats key for key."""
import json
import os
import pathlib
import shutil
import subprocess

import pytest

import reshard
from conftest import REPO

EXAMPLES = ["llama-block", "colocated", "flat-bucket", "moe-experts", "permuted-ranks"]


def cli() -> str:
    """reshard-plan: $RESHARD_PLAN, else the README build's build/bin, else PATH."""
    for c in (os.environ.get("RESHARD_PLAN"), REPO / "build" / "bin" / "reshard-plan", shutil.which("reshard-plan")):
        if c and pathlib.Path(c).is_file():
            return str(c)
    if os.environ.get("RESHARD_REQUIRE_CLI"):
        pytest.fail("reshard-plan not found (build it: cmake -S . -B build && cmake --build build --target reshard-plan)")
    pytest.skip("reshard-plan not built (cmake --build build --target reshard-plan)")


def run(*args) -> str:
    return subprocess.run([cli(), *map(str, args)], check=True, capture_output=True, text=True).stdout


@pytest.mark.parametrize("name", EXAMPLES)
def test_plan_json_equals_cli(examples, name):
    s, d = examples / name / "train.json", examples / name / "infer.json"
    src, dst = reshard.read_layout(s), reshard.read_layout(d)
    sched = reshard.plan(src, dst)
    assert sched.to_json() == run("--src", s, "--dst", d, "--json")
    stats = json.loads(run("--src", s, "--dst", d, "--stats"))
    mine = sched.stats
    assert set(mine) == set(stats)
    assert {k: v for k, v in mine.items() if k != "plan_seconds"} == {k: v for k, v in stats.items() if k != "plan_seconds"}
    r = src.ranks[-1]
    assert reshard.plan(src, dst, rank=r).to_json() == run("--src", s, "--dst", d, "--json", "--rank", r)


def test_preset_plan_equals_cli(models):
    cfg = models / "tiny-moe.json"
    src, dst = reshard.model_layouts(cfg, "tp=1,pp=2,ep=2,dp=2", "tp=4")
    out = run("--model", cfg, "--train", "tp=1,pp=2,ep=2,dp=2", "--infer", "tp=4", "--json")
    assert reshard.plan(src, dst).to_json() == out
