"""Test oracles that know nothing of reshard's planner or storage code.

Two kinds, both building every rank's expected local buffers from full
tensors with torch ops:

* ``contract_buffers``: CONTRACT.md section 1 read literally (mesh
  coordinates, dimspecs, padding, stages, concat buffers with interleave,
  flat buckets), from the layout's JSON. Works for any layout.
* ``megatron_llama_buffers`` / ``vllm_llama_buffers``: what Megatron-Core and
  vLLM themselves hold for a Llama model, written the way those frameworks
  build it (per-query-group [q; k; v] by torch.cat, [gate; up], row-parallel
  chunks, padded vocabulary), from the HuggingFace config alone.

Each expected buffer comes with a mask of its real slots (False: padding,
which a refit must leave alone).
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Optional, Tuple

import torch

import reshard

Expected = Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # name -> (values, real-slot mask)


def full_tensors(layout: reshard.Layout, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random full tensors for every tensor of the layout (HF shapes)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in layout.tensors:
        t = layout.tensor(name)
        dt = reshard.torch_dtype(t["dtype"])
        if dt.is_floating_point:
            v = torch.randn(t["shape"], generator=g, dtype=torch.float32).to(dt)
        else:
            v = torch.randint(0, 100, t["shape"], generator=g, dtype=torch.int64).to(dt)
        out[name] = v
    return out


# --- CONTRACT.md section 1, literally ------------------------------------------


class _Mesh:
    def __init__(self, j):
        self.axes = [a[0] for a in j["axes"]]
        self.sizes = {a[0]: a[1] for a in j["axes"]}
        n = math.prod(a[1] for a in j["axes"])
        self.ranks = list(j["ranks"]) if "ranks" in j else [j.get("first_rank", 0) + p for p in range(n)]

    def coords(self, rank) -> Optional[Dict[str, int]]:
        if rank not in self.ranks:
            return None
        p = self.ranks.index(rank)
        c = {}
        for a in reversed(self.axes):
            c[a] = p % self.sizes[a]
            p //= self.sizes[a]
        return c


def _refs(spec) -> List[Tuple[str, int, int]]:
    """A dimspec's axis references as (axis, stride, size or None)."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = {"axes": [spec]}
    elif isinstance(spec, list):
        spec = {"axes": spec}
    out = []
    for r in spec["axes"]:
        if isinstance(r, str):
            out.append((r, 1, None))
        else:
            out.append((r["axis"], r.get("stride", 1), r.get("size")))
    return out


def _norm(spec):
    if spec is None or isinstance(spec, (str, list)):
        return {"axes": _refs(spec)}
    d = dict(spec)
    d["axes"] = _refs(spec)
    return d


def _part(spec, mesh: _Mesh, coords) -> Tuple[int, int]:
    """(part index, part count) of a rank under a normalized dimspec."""
    k, idx = 1, 0
    for axis, stride, size in spec["axes"]:
        size = size if size is not None else mesh.sizes[axis] // stride
        idx = idx * size + (coords[axis] // stride) % size
        k *= size
    return idx, k


def _indices(spec, n: int, mesh: _Mesh, coords) -> List[int]:
    """The held index set of a dim (padding included), sorted."""
    P = spec.get("pad_to", n) or n
    p, k = _part(spec, mesh, coords)
    if "cyclic" in spec:
        B = spec["cyclic"]
        return [i for i in range(P) if (i // B) % k == p]
    split = spec.get("split", "even")
    if isinstance(split, list):
        a = sum(split[:p])
        return list(range(a, a + split[p]))
    if split == "even":
        assert P % k == 0
        return list(range(p * P // k, (p + 1) * P // k))
    if split == "chunk":
        q = -(-P // k)
        return list(range(min(P, p * q), min(P, (p + 1) * q)))
    if split == "balanced":
        base, extra = divmod(P, k)
        a = p * base + min(p, extra)
        return list(range(a, a + base + (1 if p < extra else 0)))
    raise ValueError(split)


def _local(full: torch.Tensor, tj, mesh: _Mesh, coords):
    """A tensor's local array and real mask on a rank, or None if it holds nothing."""
    for axis, c in tj.get("stage", {}).items():
        if coords[axis] != c:
            return None
    dims = tj.get("dims") or [None] * full.dim()
    vals, mask = full, torch.ones(full.shape, dtype=torch.bool)
    for d, spec in enumerate(dims):
        spec = _norm(spec)
        n = full.shape[d]
        idx = _indices(spec, n, mesh, coords)
        if not idx:
            return None
        real = torch.tensor([i < n for i in idx])
        safe = torch.tensor([min(i, n - 1) for i in idx])
        vals = vals.index_select(d, safe)
        mask = mask.index_select(d, safe)
        shape = [1] * vals.dim()
        shape[d] = len(idx)
        mask = mask & real.view(shape)
    return vals, mask


def contract_buffers(layout: reshard.Layout, full: Dict[str, torch.Tensor], rank: int) -> Expected:
    """Every local buffer of ``rank`` under ``layout``, built from CONTRACT.md section 1."""
    j = json.loads(layout.to_json())
    mesh = _Mesh(j["mesh"])
    coords = mesh.coords(rank)
    if coords is None:
        return {}
    tj = {t["name"]: t for t in j["tensors"]}
    in_buffer = set()
    out: Expected = {}
    for b in j.get("buffers", []):
        in_buffer.update(b["parts"])
        parts = [(_local(full[p], tj[p], mesh, coords)) for p in b["parts"]]
        parts = [x for x in parts if x is not None]
        if not parts:
            continue
        if "flat" in b:
            seq_v = torch.cat([v.reshape(-1) for v, _ in parts])
            seq_m = torch.cat([m.reshape(-1) for _, m in parts])
            spec = _norm(b["flat"])
            idx = _indices(spec, seq_v.numel(), mesh, coords)
            if not idx:
                continue
            n = seq_v.numel()
            safe = torch.tensor([min(i, n - 1) for i in idx])
            out[b["name"]] = (seq_v[safe], seq_m[safe] & torch.tensor([i < n for i in idx]))
            continue
        dim, G = b.get("dim", 0), b.get("interleave", 1)
        rounds_v, rounds_m = [], []
        for g in range(G):
            for v, m in parts:
                rounds_v.append(v.chunk(G, dim)[g])
                rounds_m.append(m.chunk(G, dim)[g])
        out[b["name"]] = (torch.cat(rounds_v, dim), torch.cat(rounds_m, dim))
    for name, t in tj.items():
        if name in in_buffer:
            continue
        x = _local(full[name], t, mesh, coords)
        if x is not None:
            out[name] = x
    return out


# --- Megatron-Core and vLLM, the frameworks' own way (Llama) ----------------------


def _pad_rows(t: torch.Tensor, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    pad = rows - t.shape[0]
    v = torch.cat([t, torch.zeros((pad,) + tuple(t.shape[1:]), dtype=t.dtype)])
    m = torch.ones(v.shape, dtype=torch.bool)
    m[t.shape[0]:] = False
    return v, m


def _all(v: torch.Tensor):
    return v, torch.ones(v.shape, dtype=torch.bool)


def megatron_llama_buffers(cfg: dict, full: Dict[str, torch.Tensor], tp: int, pp: int, dp: int, rank: int) -> Expected:
    """What Megatron-Core rank ``rank`` (mesh pp, dp, tp; tp fastest) holds of a Llama model, under the
    names GPTModel's ``named_parameters()`` gives (Megatron-Core 0.19, local layer spec): layer numbers
    local to the pipeline stage."""
    t = rank % tp
    stage = rank // (tp * dp)
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads, ng = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", H // heads)
    per = L // pp
    out: Expected = {}
    for i in range(stage * per, (stage + 1) * per):
        p = f"model.layers.{i}."
        d = f"decoder.layers.{i - stage * per}."
        q = full[p + "self_attn.q_proj.weight"].view(ng, heads // ng * hd, H)
        k = full[p + "self_attn.k_proj.weight"].view(ng, hd, H)
        v = full[p + "self_attn.v_proj.weight"].view(ng, hd, H)
        qkv = torch.cat([q, k, v], dim=1)  # per query group [q_g; k_g; v_g]
        out[d + "self_attention.linear_qkv.weight"] = _all(qkv.chunk(tp, 0)[t].reshape(-1, H))
        gate, up = full[p + "mlp.gate_proj.weight"], full[p + "mlp.up_proj.weight"]
        out[d + "mlp.linear_fc1.weight"] = _all(torch.cat([gate.chunk(tp, 0)[t], up.chunk(tp, 0)[t]]))
        out[d + "self_attention.linear_proj.weight"] = _all(full[p + "self_attn.o_proj.weight"].chunk(tp, 1)[t])
        out[d + "mlp.linear_fc2.weight"] = _all(full[p + "mlp.down_proj.weight"].chunk(tp, 1)[t])
        out[d + "input_layernorm.weight"] = _all(full[p + "input_layernorm.weight"])
        out[d + "pre_mlp_layernorm.weight"] = _all(full[p + "post_attention_layernorm.weight"])
    vocab = cfg["vocab_size"]
    padded = -(-vocab // (128 * tp)) * (128 * tp)
    for hf, name, on in (("model.embed_tokens.weight", "embedding.word_embeddings.weight", 0),
                         ("lm_head.weight", "output_layer.weight", pp - 1)):
        if stage == on:
            v, m = _pad_rows(full[hf], padded)
            out[name] = (v.chunk(tp)[t], m.chunk(tp)[t])
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = _all(full["model.norm.weight"])
    return out


def vllm_llama_buffers(cfg: dict, full: Dict[str, torch.Tensor], tp: int, first_rank: int, rank: int) -> Expected:
    """What vLLM rank ``rank`` (tp only) holds of a Llama model: [q; k; v] per rank, kv heads replicated past tp = kv heads."""
    t = rank - first_rank
    L, ng = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    kv_shard = t // (tp // ng) if tp > ng else t
    kv_parts = min(tp, ng)
    out: Expected = {}
    for i in range(L):
        p = f"model.layers.{i}."
        q = full[p + "self_attn.q_proj.weight"].chunk(tp)[t]
        k = full[p + "self_attn.k_proj.weight"].chunk(kv_parts)[kv_shard]
        v = full[p + "self_attn.v_proj.weight"].chunk(kv_parts)[kv_shard]
        out[p + "self_attn.qkv_proj.weight"] = _all(torch.cat([q, k, v]))
        gate, up = full[p + "mlp.gate_proj.weight"], full[p + "mlp.up_proj.weight"]
        out[p + "mlp.gate_up_proj.weight"] = _all(torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]]))
        out[p + "self_attn.o_proj.weight"] = _all(full[p + "self_attn.o_proj.weight"].chunk(tp, 1)[t])
        out[p + "mlp.down_proj.weight"] = _all(full[p + "mlp.down_proj.weight"].chunk(tp, 1)[t])
        out[p + "input_layernorm.weight"] = _all(full[p + "input_layernorm.weight"])
        out[p + "post_attention_layernorm.weight"] = _all(full[p + "post_attention_layernorm.weight"])
    padded = -(-cfg["vocab_size"] // 64) * 64
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        v, m = _pad_rows(full[name], padded)
        out[name] = (v.chunk(tp)[t], m.chunk(tp)[t])
    out["model.norm.weight"] = _all(full["model.norm.weight"])
    return out


def check(got: Dict[str, torch.Tensor], expected: Expected, poison, where: str) -> int:
    """Every real slot equals the oracle, every padding slot still holds ``poison``; returns the elements checked."""
    assert set(got) == set(expected), f"{where}: buffers {sorted(got)} != expected {sorted(expected)}"
    n = 0
    for name, (v, m) in expected.items():
        g = got[name]
        assert g.numel() == v.numel(), f"{where}: {name}: {g.numel()} elements, expected {v.numel()}"
        g = g.reshape(v.shape)
        bad = (g != v) & m
        if bad.any():
            i = bad.nonzero()[0].tolist()
            raise AssertionError(f"{where}: {name}{i}: got {g[tuple(i)].item()}, expected {v[tuple(i)].item()} "
                                 f"({int(bad.sum())} wrong of {int(m.sum())})")
        pad = ~m
        if pad.any():
            assert (g[pad] == poison).all(), f"{where}: {name}: a padding slot was written"
        n += int(m.sum())
    return n


def refit_buffers(src: reshard.Layout, dst: reshard.Layout, full: Dict[str, torch.Tensor], poison, split: bool = True):
    """Every rank's buffers for a refit_local of ``full``: sources from the contract oracle, destinations
    filled with ``poison``; per rank ``{"src": ..., "dst": ...}``, or one dict where ``split`` is False."""
    bufs = {}
    for r in src.ranks:
        bufs.setdefault(r, {"src": {}, "dst": {}})["src"] = {
            n: v.clone() for n, (v, _) in contract_buffers(src, full, r).items()}
    for r in dst.ranks:
        bufs.setdefault(r, {"src": {}, "dst": {}})["dst"] = reshard.allocate(dst, r, fill=poison)
    if split:
        return bufs
    return {r: {**b["src"], **b["dst"]} for r, b in bufs.items()}
