"""Casts in flight (``cast=True``): an f32 (or bf16 / f16) source refit into a destination of another
float dtype, resharding at the same time, every destination element equal to torch's own conversion
(``Tensor.to``) of its source element, placed by the contract oracle (oracle.py)."""
import json

import pytest
import torch

import oracle
import reshard

POISON = -7.0


def with_dtype(layout, dtype):
    j = json.loads(layout.to_json())
    for t in j["tensors"]:
        t["dtype"] = dtype
    return reshard.layout_from_json(j, f"{dtype} copy")


def probe_tensors(layout, seed, dtype):
    """Random full tensors of ``dtype`` with torch's rounding edge cases mixed in (ties of bf16 and f16,
    f16 overflow and subnormals, infinities, signed zeros)."""
    full = oracle.full_tensors(with_dtype(layout, "f32"), seed=seed)
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([0.0, -0.0, 1.00390625, 1.01171875, 65504.0, 65519.0, 65520.0, 1e5, 6e-8, 3e-8,
                            float("inf"), float("-inf"), 1e-40, 3.0e38], dtype=torch.float32)
    out = {}
    for n, t in full.items():
        v = t.reshape(-1) * torch.exp2(torch.randint(-20, 12, (t.numel(),), generator=g).float())
        k = min(v.numel(), special.numel())
        v[:k] = special[:k]
        out[n] = v.reshape(t.shape).to(getattr(torch, {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[dtype]))
    return out


@pytest.mark.parametrize("src_dtype,dst_dtype", [("f32", "bf16"), ("f32", "f16"), ("bf16", "f32"), ("f16", "bf16")])
def test_cast_in_flight_equals_torch_conversion(models, src_dtype, dst_dtype):
    cfg = models / "tiny-llama.json"
    src = with_dtype(reshard.megatron_layout(cfg, "tp=2"), src_dtype)
    dst = with_dtype(reshard.vllm_layout(cfg, "tp=4", first_rank=2), dst_dtype)
    full = probe_tensors(src, 3, src_dtype)
    expected_full = {n: t.to(reshard.torch_dtype(dst_dtype)) for n, t in full.items()}  # torch is the oracle
    bufs = oracle.refit_buffers(src, dst, full, POISON)
    with pytest.raises(reshard.LayoutError, match="cast=True"):
        reshard.refit_local(src, dst, bufs)
    rep = reshard.refit_local(src, dst, bufs, cast=True)
    checked = sum(oracle.check(bufs[r]["dst"], oracle.contract_buffers(dst, expected_full, r), POISON, f"rank {r}")
                  for r in dst.ranks)
    assert checked >= sum(t.numel() for t in full.values())  # every element somewhere (replicated kv heads twice)
    # Every destination element crosses (the sides share no rank), at the destination's size.
    assert rep["bytes_moved"] == reshard.plan(src, dst, cast=True).stats["bytes"]
    assert rep["bytes_moved"] == checked * reshard.torch_dtype(dst_dtype).itemsize


def test_cast_is_refused_for_non_float_dtypes(models):
    cfg = models / "tiny-llama.json"
    src = reshard.megatron_layout(cfg, "tp=2")
    dst = with_dtype(reshard.vllm_layout(cfg, "tp=2", first_rank=2), "i32")
    with pytest.raises(reshard.LayoutError, match="dtype i32 differs from bf16"):
        reshard.plan(src, dst, cast=True)
