"""FP8 destinations (docs/fp8.md) against torch's own float8_e4m3fn cast as a second
reference: BF16 training pieces refit into block-FP8 and MXFP8 inference pieces, values and
scales compared bitwise after reassembling the full tensors."""
import json

import pytest
import torch

import reshard

F8 = torch.float8_e4m3fn


def layouts(src_rows, scheme):
    w = {"name": "w", "shape": [256, 320], "dtype": "bf16",
         "dims": [{"axes": ["tp"], "split": src_rows}, None]}
    src = {"mesh": {"axes": [["tp", 2]]}, "tensors": [w]}
    if scheme == "block":
        q = {"scheme": "block", "block": [64, 32], "scale": "w_scale_inv"}
        scale = {"name": "w_scale_inv", "shape": [4, 10], "dtype": "f32", "dims": [None, "tp"]}
    else:
        q = {"scheme": "mx", "scale": "w_scale"}
        scale = {"name": "w_scale", "shape": [256, 10], "dtype": "u8", "dims": [None, "tp"]}
    dst = {"mesh": {"axes": [["tp", 2]], "first_rank": 2},
           "tensors": [{"name": "w", "shape": [256, 320], "dtype": "fp8e4m3", "dims": [None, "tp"], "quant": q}, scale]}
    return reshard.layout_from_json(json.dumps(src)), reshard.layout_from_json(json.dumps(dst))


def torch_block(x, br, bc):
    """DeepSeek-V3 / vLLM block FP8 as the contract states it, with torch's cast."""
    R, C = x.shape
    t = x.float().reshape(R // br, br, C // bc, bc)
    amax = t.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    mul = torch.tensor(448.0) / amax  # the quotient in f32 first
    q = (t * mul).clamp(-448, 448).to(F8).reshape(R, C)
    return q.view(torch.uint8), (amax / 448.0).reshape(R // br, C // bc)


def torch_mx(x):
    R, C = x.shape
    t = x.float().reshape(R, C // 32, 32)
    amax = t.abs().amax(dim=2, keepdim=True)
    e = (torch.floor(torch.log2(amax)) - 8).clamp(-127, 127)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    q = (t / torch.exp2(e)).clamp(-448, 448).to(F8).reshape(R, C)
    byte = torch.where(amax == 0, torch.zeros_like(e), e + 127).to(torch.uint8).reshape(R, C // 32)
    return q.view(torch.uint8), byte


@pytest.mark.parametrize("scheme", ["block", "mx"])
@pytest.mark.parametrize("src_rows", [[128, 128], [100, 156]])  # tile-aligned (sender) or not (receiver)
def test_fp8_matches_torch_cast(scheme, src_rows):
    src, dst = layouts(src_rows, scheme)
    g = torch.Generator().manual_seed(5)
    # Values over many binades, some tiles all zero.
    scales = torch.exp2(torch.randint(-20, 10, (256, 320), generator=g).float())
    full = (torch.randn(256, 320, generator=g) * scales).to(torch.bfloat16)
    full[:64, :32] = 0
    bufs = {0: {"src": {"w": full[:src_rows[0]].clone()}}, 1: {"src": {"w": full[src_rows[0]:].clone()}}}
    scale_name = "w_scale_inv" if scheme == "block" else "w_scale"
    for r, cols in ((2, slice(0, 160)), (3, slice(160, 320))):
        bufs[r] = {"dst": {"w": torch.full((256, 160), 0x7F, dtype=torch.uint8),
                           scale_name: torch.full((4, 5) if scheme == "block" else (256, 5), 7,
                                                  dtype=torch.float32 if scheme == "block" else torch.uint8)}}
    sched = json.loads(reshard.plan(src, dst).to_json())
    kinds = {c.get("quantize") for c in sched["copies"]}
    assert ("receiver" in kinds) == (src_rows[0] % (64 if scheme == "block" else 1) != 0)
    reshard.refit_local(src, dst, bufs)
    got = torch.cat([bufs[2]["dst"]["w"], bufs[3]["dst"]["w"]], dim=1)
    got_scale = torch.cat([bufs[2]["dst"][scale_name], bufs[3]["dst"][scale_name]], dim=1)
    if scheme == "block":
        want, want_scale = torch_block(full, 64, 32)
        assert torch.equal(got_scale.view(torch.int32), want_scale.contiguous().view(torch.int32))
    else:
        want, want_scale = torch_mx(full)
        assert torch.equal(got_scale, want_scale)
    assert torch.equal(got, want)


def test_the_engines_reference_quantizer_agrees_with_the_core_on_partial_tiles():
    # reshard.engines.fp8.reference_quantize (torch ops, the reference of the FP8 engine tests and the peer's
    # quantizer) against the core's quantizer: 200 x 300 in 128 x 128 tiles (partial tiles at both ends).
    from reshard.engines.fp8 import reference_quantize, tiles
    src = reshard.layout_from_json(json.dumps({"mesh": {"axes": [["tp", 1]]}, "tensors": [
        {"name": "w", "shape": [200, 300], "dtype": "bf16"}]}))
    dst = reshard.layout_from_json(json.dumps({"mesh": {"axes": [["tp", 1]], "first_rank": 1}, "tensors": [
        {"name": "w", "shape": [200, 300], "dtype": "fp8e4m3",
         "quant": {"scheme": "block", "block": [128, 128], "scale": "w_scale_inv"}},
        {"name": "w_scale_inv", "shape": tiles([200, 300], [128, 128]), "dtype": "f32"}]}))
    g = torch.Generator().manual_seed(7)
    full = (torch.randn(200, 300, generator=g) * torch.exp2(torch.randint(-12, 8, (200, 300), generator=g))).bfloat16()
    full[128:, 256:] = 0  # an all-zero tile: amax clamps to 1e-4
    w, s = torch.zeros(200, 300, dtype=torch.uint8), torch.zeros(2, 3)
    reshard.refit_local(src, dst, {0: {"w": full}, 1: {"w": w, "w_scale_inv": s}})
    q, scale = reference_quantize(full, (128, 128))
    assert torch.equal(w, q.view(torch.uint8)) and torch.equal(s.view(torch.int32), scale.view(torch.int32))


def test_a_traced_fp8_layout_marks_its_quantized_tensors_and_stores_each_scale_alone():
    # What vLLM's loader makes of an FP8 checkpoint at tp=2: q and k fused in one parameter, their scales
    # fused in another. quantized_layout marks q and k quant (block, their scales) and takes the fused scale
    # buffer apart (the core stores a scale tensor alone; the engine binds each to its rows).
    from reshard.engines.fp8 import quantized_layout
    tensors = [{"name": "q.weight", "shape": [512, 256], "dtype": "fp8e4m3", "dims": ["tp", None]},
               {"name": "k.weight", "shape": [256, 256], "dtype": "fp8e4m3", "dims": ["tp", None]},
               {"name": "q.weight_scale_inv", "shape": [4, 2], "dtype": "f32", "dims": ["tp", None]},
               {"name": "k.weight_scale_inv", "shape": [2, 2], "dtype": "f32", "dims": ["tp", None]},
               {"name": "norm.weight", "shape": [256], "dtype": "bf16"}]
    traced = reshard.layout_from_json(json.dumps({"mesh": {"axes": [["tp", 2]]}, "tensors": tensors, "buffers": [
        {"name": "qk.weight", "parts": ["q.weight", "k.weight"]},
        {"name": "qk.weight_scale_inv", "parts": ["q.weight_scale_inv", "k.weight_scale_inv"]}]}))
    layout, apart = quantized_layout(traced, {"q.weight", "k.weight"}, (128, 128))
    assert apart == {"qk.weight_scale_inv": ["q.weight_scale_inv", "k.weight_scale_inv"]}
    doc = json.loads(layout.to_json())
    quant = {t["name"]: t.get("quant") for t in doc["tensors"]}
    assert quant["q.weight"] == {"scheme": "block", "block": [128, 128], "scale": "q.weight_scale_inv"}
    assert quant["k.weight"]["scale"] == "k.weight_scale_inv" and quant["norm.weight"] is None
    assert [b["name"] for b in doc["buffers"]] == ["qk.weight"]
    assert {b["name"]: b["shape"] for b in layout.buffers(0)}["q.weight_scale_inv"] == (2, 2)
    # A scale fused beside a tensor that is no scale cannot be bound by rows: refused, naming the buffer.
    extra = {"name": "bias_table", "shape": [4, 2], "dtype": "f32", "dims": ["tp", None]}
    mixed = reshard.layout_from_json(json.dumps({"mesh": {"axes": [["tp", 2]]}, "tensors": tensors + [extra],
                                                 "buffers": [{"name": "odd", "parts": ["q.weight_scale_inv", "bias_table"]}]}))
    with pytest.raises(reshard.Error, match="buffer 'odd' holds scale tensors"):
        quantized_layout(mixed, {"q.weight"}, (128, 128))
