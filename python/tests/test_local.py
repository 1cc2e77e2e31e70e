"""reshard.refit_local on example and preset layouts, every element checked against oracles
built from full tensors (oracle.py), plus the API's shape, dtype and buffer checks."""
import json

import pytest
import torch

import oracle
import reshard

EXAMPLES = ["llama-block", "colocated", "flat-bucket", "moe-experts", "permuted-ranks"]
POISON = -7.0


def pair(examples, name):
    return (reshard.read_layout(examples / name / "train.json"), reshard.read_layout(examples / name / "infer.json"))


def buffers_for(src, dst, full, split=True):
    """Sources from the contract oracle, destinations poisoned; the two sides apart or together."""
    return oracle.refit_buffers(src, dst, full, POISON, split)


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_every_element(examples, name):
    src, dst = pair(examples, name)
    full = oracle.full_tensors(src, seed=1)
    bufs = buffers_for(src, dst, full)
    rep = reshard.refit_local(src, dst, bufs)
    assert rep["bytes_moved"] == reshard.plan(src, dst).stats["bytes"]
    assert rep["seconds"] > 0
    checked = 0
    for r in dst.ranks:
        checked += oracle.check(bufs[r]["dst"], oracle.contract_buffers(dst, full, r), POISON, f"{name} rank {r}")
    assert checked > 0


def test_plain_buffer_dict_and_flat_tensors(examples):
    """{name: tensor} per rank (no split), destinations given 1-D: the buffer is its row-major order."""
    src, dst = pair(examples, "llama-block")
    full = oracle.full_tensors(src, seed=2)
    bufs = buffers_for(src, dst, full, split=False)
    flat = {r: {n: t.reshape(-1) for n, t in reshard.allocate(dst, r, fill=POISON).items()} for r in dst.ranks}
    for r in dst.ranks:
        bufs[r].update(flat[r])
    reshard.refit_local(src, dst, bufs)
    for r in dst.ranks:
        oracle.check(flat[r], oracle.contract_buffers(dst, full, r), POISON, f"rank {r}")


def test_strided_destination_views(examples):
    """A non-contiguous tensor of the buffer's shape is written in place (no hidden copy)."""
    src, dst = pair(examples, "llama-block")
    full = oracle.full_tensors(src, seed=3)
    bufs = buffers_for(src, dst, full)
    bases = {}
    for r in dst.ranks:
        for b in reshard.buffer_specs(dst, r):
            if len(b["shape"]) != 2:
                continue
            rows, cols = b["shape"]
            base = torch.full((rows, cols + 5), POISON, dtype=reshard.torch_dtype(b["dtype"]))
            bases[(r, b["name"])] = base
            bufs[r]["dst"][b["name"]] = base[:, 2:2 + cols]
    reshard.refit_local(src, dst, bufs)
    for r in dst.ranks:
        exp = oracle.contract_buffers(dst, full, r)
        oracle.check(bufs[r]["dst"], exp, POISON, f"rank {r}")
    for (r, n), base in bases.items():
        assert (base[:, :2] == POISON).all() and (base[:, -3:] == POISON).all(), f"rank {r} {n}: wrote outside the view"


def llama_cfg(models):
    return json.loads((models / "tiny-llama.json").read_text())


@pytest.mark.parametrize("train,tp,pp,dp,infer_tp", [("tp=2,pp=2", 2, 2, 1, 4), ("tp=1,pp=2,dp=2", 1, 2, 2, 2)])
def test_tiny_llama_megatron_to_vllm(models, train, tp, pp, dp, infer_tp):
    """Sources built the Megatron way, destinations checked the vLLM way (torch.cat / chunk, padded vocab)."""
    cfg = llama_cfg(models)
    src = reshard.megatron_layout(models / "tiny-llama.json", train)
    dst = reshard.vllm_layout(models / "tiny-llama.json", f"tp={infer_tp}", first_rank=len(src.ranks))
    full = oracle.full_tensors(src, seed=4)
    bufs = {}
    for r in src.ranks:
        meg = oracle.megatron_llama_buffers(cfg, full, tp, pp, dp, r)
        # The contract oracle agrees with Megatron's own construction.
        con = oracle.contract_buffers(src, full, r)
        assert set(meg) == set(con)
        for n in meg:
            assert torch.equal(meg[n][1], con[n][1]), n
            assert torch.equal(meg[n][0][meg[n][1]], con[n][0][con[n][1]]), n
        bufs[r] = {n: v.clone() for n, (v, _) in meg.items()}
    for r in dst.ranks:
        bufs[r] = reshard.allocate(dst, r, fill=POISON)
    rep = reshard.refit_local(src, dst, bufs, iterations=2)
    assert len(rep["iteration_seconds"]) == 2
    for r in dst.ranks:
        oracle.check(bufs[r], oracle.vllm_llama_buffers(cfg, full, infer_tp, len(src.ranks), r), POISON, f"vllm rank {r}")


def test_tiny_moe_presets(models):
    src = reshard.megatron_layout(models / "tiny-moe.json", "tp=1,pp=2,ep=2,dp=2")
    dst = reshard.vllm_layout(models / "tiny-moe.json", "tp=4", first_rank=len(src.ranks))
    full = oracle.full_tensors(src, seed=5)
    bufs = buffers_for(src, dst, full)
    rep = reshard.refit_local(src, dst, bufs)
    assert rep["bytes_moved"] > 0
    for r in dst.ranks:
        oracle.check(bufs[r]["dst"], oracle.contract_buffers(dst, full, r), POISON, f"moe rank {r}")


def test_two_refits_with_changed_weights(examples):
    src, dst = pair(examples, "moe-experts")
    full = oracle.full_tensors(src, seed=6)
    bufs = buffers_for(src, dst, full)
    reshard.refit_local(src, dst, bufs)
    full2 = oracle.full_tensors(src, seed=7)
    for r in src.ranks:  # new values, same tensors (in place)
        for n, (v, _) in oracle.contract_buffers(src, full2, r).items():
            bufs[r]["src"][n].copy_(v)
    reshard.refit_local(src, dst, bufs)
    for r in dst.ranks:
        oracle.check(bufs[r]["dst"], oracle.contract_buffers(dst, full2, r), POISON, f"rank {r}")


# --- the API's checks ------------------------------------------------------------


@pytest.fixture()
def block(examples):
    src, dst = pair(examples, "llama-block")
    full = oracle.full_tensors(src, seed=8)
    return src, dst, buffers_for(src, dst, full)


QKV = "model.layers.0.self_attn.qkv_proj.weight"


def test_wrong_dtype(block):
    src, dst, bufs = block
    bufs[8]["dst"][QKV] = bufs[8]["dst"][QKV].float()
    with pytest.raises(reshard.Error, match=rf"rank 8: destination buffer '{QKV}': dtype f32 but the layout stores bf16"):
        reshard.refit_local(src, dst, bufs)


def test_wrong_element_count(block):
    src, dst, bufs = block
    bufs[9]["dst"][QKV] = bufs[9]["dst"][QKV][:-1].clone()
    rows, cols = next(b["shape"] for b in reshard.buffer_specs(dst, 9) if b["name"] == QKV)
    with pytest.raises(reshard.Error, match=rf"rank 9: destination buffer '{QKV}': {(rows - 1) * cols} elements but the layout "
                                            rf"gives this rank {rows * cols} elements of bf16, shape \[{rows}, {cols}\]"):
        reshard.refit_local(src, dst, bufs)


def test_wrong_shape_not_contiguous(block):
    src, dst, bufs = block
    bufs[8]["dst"][QKV] = torch.zeros(64, 100, dtype=torch.bfloat16).t()[:, :63]
    with pytest.raises(reshard.Error, match="must have the buffer's shape exactly"):
        reshard.refit_local(src, dst, bufs)


def test_missing_buffer(block):
    src, dst, bufs = block
    del bufs[10]["dst"][QKV]
    with pytest.raises(reshard.Error, match=rf"rank 10: destination buffer '{QKV}' is missing"):
        reshard.refit_local(src, dst, bufs)


def test_unknown_buffer(block):
    src, dst, bufs = block
    bufs[10]["dst"]["nope"] = torch.zeros(3)
    with pytest.raises(reshard.Error, match="rank 10: destination buffer 'nope' is not a buffer"):
        reshard.refit_local(src, dst, bufs)
    with pytest.raises(reshard.Error, match="buffer 'nope' is neither a source buffer"):
        reshard.refit_local(src, dst, {10: {"nope": torch.zeros(3)}})


def test_not_a_tensor_and_read_only(block, examples):
    src, dst, bufs = block
    bufs[8]["dst"][QKV] = [1, 2, 3]
    with pytest.raises(reshard.Error, match="through DLPack"):
        reshard.refit_local(src, dst, bufs)
    f_src, f_dst = pair(examples, "flat-bucket")  # f32: numpy works
    full = oracle.full_tensors(f_src, seed=9)
    nb = buffers_for(f_src, f_dst, full)
    for r in f_dst.ranks:
        nb[r]["dst"] = reshard.allocate(f_dst, r, "numpy", fill=POISON)
    for r in f_src.ranks:
        nb[r]["src"] = {n: t.numpy() for n, t in nb[r]["src"].items()}
        for a in nb[r]["src"].values():
            a.flags.writeable = False  # sources may be read-only
    reshard.refit_local(f_src, f_dst, nb)
    for r in f_dst.ranks:
        oracle.check({n: torch.from_numpy(a) for n, a in nb[r]["dst"].items()}, oracle.contract_buffers(f_dst, full, r),
                     POISON, f"numpy rank {r}")
    a = next(iter(nb[f_dst.ranks[0]]["dst"].values()))
    a.flags.writeable = False
    with pytest.raises(reshard.Error, match="read-only"):
        reshard.refit_local(f_src, f_dst, nb)


def test_requires_grad_parameters_are_refit_in_place(block):
    src, dst, bufs = block
    p = torch.nn.Parameter(bufs[8]["dst"][QKV].clone())
    bufs[8]["dst"][QKV] = p
    reshard.refit_local(src, dst, bufs)
    assert not (p.detach() == POISON).all()


def test_layout_errors(tmp_path, models):
    with pytest.raises(reshard.LayoutError, match="nope.json: cannot open"):
        reshard.read_layout(tmp_path / "nope.json")
    with pytest.raises(reshard.LayoutError, match="malformed JSON"):
        reshard.layout_from_json("{")
    with pytest.raises(reshard.Error, match="mesh"):
        reshard.layout_from_json({"tensors": []})
    with pytest.raises(reshard.Error, match="unknown key 'xp'"):
        reshard.megatron_layout(models / "tiny-llama.json", "xp=2")
    src = reshard.megatron_layout(models / "tiny-llama.json", "tp=2")
    other = reshard.layout_from_json({"mesh": {"axes": [["tp", 1]], "first_rank": 2},
                                      "tensors": [{"name": "x", "shape": [4], "dtype": "f32"}]})
    with pytest.raises(reshard.LayoutError, match="'x'"):
        reshard.plan(src, other)
    assert issubclass(reshard.LayoutError, reshard.Error) and issubclass(reshard.RefitNotCommitted, reshard.TransportError)


def test_listing_and_allocate(examples):
    src, dst = pair(examples, "llama-block")
    specs = reshard.buffer_specs(dst, 8)
    assert {b["name"] for b in specs} == set(reshard.allocate(dst, 8))
    qkv = next(b for b in specs if b["name"] == QKV)
    assert qkv["shape"] == (32, 64) and qkv["dtype"] == "bf16" and qkv["elements"] == 32 * 64
    assert qkv["tensors"][0] == "model.layers.0.self_attn.q_proj.weight"
    assert reshard.buffer_specs(dst, 0) == []
    assert "pp=2 x dp=2 x tp=2" in repr(src) and "86 copies" in repr(reshard.plan(src, dst))
    sd = reshard.allocate(dst, 9)
    assert set(reshard.buffers_from_state_dict({"m." + k: v for k, v in sd.items()}, dst, 9, prefix="m.")) == set(sd)
    with pytest.raises(reshard.Error, match="lacks"):
        reshard.buffers_from_state_dict({}, dst, 9)
    layout_json = json.loads(src.to_json())
    assert reshard.plan(reshard.layout_from_json(layout_json), dst).to_json() == reshard.plan(src, dst).to_json()


def test_gil_released_during_refit_local(models):
    """Another Python thread runs while refit_local plans and moves data."""
    import threading
    import time

    src = reshard.megatron_layout(models / "tiny-moe.json", "tp=1,pp=2,ep=2,dp=2")
    dst = reshard.vllm_layout(models / "tiny-moe.json", "tp=4", first_rank=len(src.ranks))
    bufs = {}
    for r in src.ranks:
        bufs[r] = reshard.allocate(src, r, fill=1)
    for r in dst.ranks:
        bufs[r] = reshard.allocate(dst, r)
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    th = threading.Thread(target=tick)
    th.start()
    time.sleep(0.01)
    t0 = time.monotonic()
    reshard.refit_local(src, dst, bufs, iterations=20)
    t1 = time.monotonic()
    stop.set()
    th.join()
    inside = [t for t in ticks if t0 + 0.1 * (t1 - t0) < t < t1 - 0.1 * (t1 - t0)]
    assert len(inside) >= 5, f"{len(inside)} ticks of the other thread during {t1 - t0:.3f} s of refit_local"
