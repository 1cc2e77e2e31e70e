"""reshard.Resharder across processes that no mpirun started: torch.multiprocessing
(spawn), a torch.distributed.TCPStore on 127.0.0.1, UCX on loopback."""
import datetime
import functools
import json
import os
import pathlib
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import oracle
import reshard

pytestmark = pytest.mark.skipif(not reshard.has_ucx, reason="reshard built without UCX")

POISON = -7.0
# Debian's UCX 1.13 on one host: TCP over loopback, shared memory, self.
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layouts(models):
    cfg = models / "tiny-llama.json"
    src = reshard.megatron_layout(cfg, "tp=2")
    return src, reshard.vllm_layout(cfg, "tp=1", first_rank=len(src.ranks))


def tiny_llama_rank(models, rank, seed):
    """The layouts, config and full tensors of the tiny-llama job, and `rank`'s buffers: its source buffers
    (the contract's local pieces of the full tensors) and its destination buffers filled with POISON."""
    src, dst = layouts(models)
    cfg = json.loads((models / "tiny-llama.json").read_text())
    full = oracle.full_tensors(src, seed=seed)
    bufs = {}
    if rank in src.ranks:
        bufs = {n: v.clone() for n, (v, _) in oracle.contract_buffers(src, full, rank).items()}
    if rank in dst.ranks:
        bufs.update(reshard.allocate(dst, rank, fill=POISON))
    return src, dst, cfg, full, bufs


class DictStore:
    """Any object with set(key, bytes) and get(key) -> bytes (KeyError when missing): here a
    multiprocessing.Manager dict shared by the processes."""

    def __init__(self, d):
        self.d = d

    def set(self, key, value):
        self.d[key] = value

    def get(self, key):
        return self.d[key]


class RankOutcome:
    """What a worker reports on the job's queue, as run_job reads it: (rank, "ok", reports, checked, seconds),
    (rank, "error", error class, message, seconds) for a reshard.Error, or (rank, "crash", traceback, None,
    None) for anything else. The seconds count from construction or the last restart_clock()."""

    def __init__(self, rank, q):
        self.rank, self.q = rank, q
        self.restart_clock()

    def restart_clock(self):
        self.t0 = time.monotonic()

    def ok(self, reports, checked):
        self.q.put((self.rank, "ok", reports, checked, time.monotonic() - self.t0))

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is None:
            return False
        if issubclass(kind, reshard.Error):
            self.q.put((self.rank, "error", kind.__name__, str(error), time.monotonic() - self.t0))
        else:
            self.q.put((self.rank, "crash", "".join(traceback.format_exception(kind, error, tb)), None, None))
        return True  # reported: the process ends normally


def worker(rank, port, models, mode, q):
    """One process of the job. Modes: ok (two refits with changed weights), dies (rank 2 exits
    before the second refit), bad (rank 1 gives a wrong dtype). `port` is a TCPStore port, or a
    Manager dict (the generic store)."""
    with RankOutcome(rank, q) as outcome:
        import reshard as rs  # noqa: F401  (spawned: a fresh interpreter)

        if isinstance(port, tuple):  # (port, True): rank 0 hosts the store; (port, False): the parent does
            store = torch.distributed.TCPStore("127.0.0.1", port[0], None, port[1] and rank == 0,
                                               timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        else:
            store = DictStore(port)
        src, dst, cfg, full, bufs = tiny_llama_rank(models, rank, seed=11)
        if mode == "bad" and rank == 1:
            n = next(iter(bufs))
            bufs[n] = bufs[n].float()
        outcome.restart_clock()
        double = mode == "double"
        back = reshard.allocate(dst, rank, fill=POISON) if double and rank in dst.ranks else None
        r = reshard.Resharder(src, dst, rank=rank, buffers=bufs, transport="ucx", store=store, stall_timeout=10,
                              double_buffered=double, back_buffers=back)
        reports = [r.refit()]
        checked = 0
        if rank in dst.ranks:
            v1 = oracle.vllm_llama_buffers(cfg, full, 1, len(src.ranks), rank)
            if double:  # the back set was written and is now served; the front one untouched
                assert r.serving_set == 1
                checked += oracle.check(back, v1, POISON, "refit 1 (back set)")
                assert all((t == POISON).all() for t in bufs.values())
            else:
                checked += oracle.check(bufs, v1, POISON, "refit 1")
        # New weights, written in place into the bound source tensors.
        full2 = oracle.full_tensors(src, seed=12)
        if rank in src.ranks:
            for n, (v, _) in oracle.contract_buffers(src, full2, rank).items():
                bufs[n].copy_(v)
        if mode == "dies" and rank == 2:
            os._exit(3)
        outcome.restart_clock()
        reports.append(r.refit())
        if rank in dst.ranks:
            checked += oracle.check(bufs, oracle.vllm_llama_buffers(cfg, full2, 1, len(src.ranks), rank), POISON, "refit 2")
            if double:
                assert r.serving_set == 0
                oracle.check(back, v1, POISON, "back set after refit 2")
        r.close()
        outcome.ok(reports, checked)


def colocated_worker(rank, port, examples, q):
    """Each process is a rank of both sides (examples/colocated): its buffers given as {"src", "dst"}."""
    with RankOutcome(rank, q) as outcome:
        store = torch.distributed.TCPStore("127.0.0.1", port[0], None, False, timeout=datetime.timedelta(seconds=60))
        src = reshard.read_layout(examples / "colocated" / "train.json")
        dst = reshard.read_layout(examples / "colocated" / "infer.json")
        full = oracle.full_tensors(src, seed=21)
        bufs = {"src": {n: v.clone() for n, (v, _) in oracle.contract_buffers(src, full, rank).items()},
                "dst": reshard.allocate(dst, rank, fill=POISON)}
        with reshard.Resharder(src, dst, rank=rank, buffers=bufs, store=store, stall_timeout=10) as r:
            rep = r.refit()
        checked = oracle.check(bufs["dst"], oracle.contract_buffers(dst, full, rank), POISON, f"rank {rank}")
        outcome.ok([rep], checked)


# Per version after the first: the fraction of every tensor's elements given new values, and whether
# the destination rank overwrites its buffers (as inference post-processing would) and asks for a
# dense refit. dense_above is 0.25; after a dense refit the next ones are a streak of dense refits.
DELTA_VERSIONS = [(0.0, False), (0.01, False), (0.02, True), (0.03, False), (0.5, False), (0.01, False)]
DELTA_MODES = ["prime", "delta", "delta", "dense", "delta", "dense", "streak"]


def evolve(full, fraction, version):
    """New values for `fraction` of every tensor's elements, the same in every process (seeded by version)."""
    g = torch.Generator().manual_seed(1000 + version)
    out = {}
    for name in sorted(full):
        t = full[name].clone()
        flat = t.view(-1)
        k = round(fraction * flat.numel())
        if k:
            idx = torch.randperm(flat.numel(), generator=g)[:k]
            flat[idx] = torch.randn(k, generator=g).to(t.dtype)
        out[name] = t
    return out


def pitched(bufs):
    """Each 2-d tensor as a view into a larger one (3 more columns, which a refit must never write): a
    non-contiguous buffer. Returns the views and the larger tensors."""
    out, bigs = {}, []
    for n, t in bufs.items():
        if t.dim() == 2:
            big = torch.full((t.shape[0], t.shape[1] + 3), POISON, dtype=t.dtype)
            big[:, :t.shape[1]].copy_(t)
            out[n] = big[:, :t.shape[1]]
            bigs.append(big)
        else:
            out[n] = t
    return out, bigs


def delta_worker(rank, port, models, q, double=False, strided=False):
    """Delta refits over versions whose weights change in a known fraction; every element checked each time.
    With `strided`, the 2-d buffers of both sides are views into larger tensors."""
    with RankOutcome(rank, q) as outcome:
        store = torch.distributed.TCPStore("127.0.0.1", port[0], None, False, timeout=datetime.timedelta(seconds=60))
        src, dst, cfg, full, bufs = tiny_llama_rank(models, rank, seed=31)
        bigs = []
        if strided:
            bufs, bigs = pitched(bufs)
            assert any(not t.is_contiguous() for t in bufs.values())
        back = reshard.allocate(dst, rank, fill=POISON) if double and rank in dst.ranks else None
        r = reshard.Resharder(src, dst, rank=rank, buffers=bufs, store=store, stall_timeout=10, delta=True, dense_above=0.25,
                              double_buffered=double, back_buffers=back)
        reports, checked = [], 0
        for v in range(1, len(DELTA_VERSIONS) + 2):
            if v > 1:
                fraction, overwrite = DELTA_VERSIONS[v - 2]
                full = evolve(full, fraction, v)
                if rank in src.ranks:
                    for n, (x, _) in oracle.contract_buffers(src, full, rank).items():
                        bufs[n].copy_(x)
                if overwrite and rank in dst.ranks:
                    for t in list(bufs.values()) + list((back or {}).values()):
                        t.fill_(POISON)
                    r.invalidate_delta_base()  # this rank alone
            rep = r.refit()
            reports.append(rep)
            if rank in dst.ranks:
                served = back if double and r.serving_set == 1 else bufs
                checked += oracle.check(served, oracle.vllm_llama_buffers(cfg, full, 1, len(src.ranks), rank), POISON,
                                        f"version {v} ({rep['delta']['mode']})")
        assert all((big[:, -3:] == POISON).all() for big in bigs), "a refit wrote past a strided view's columns"
        r.close()
        outcome.ok(reports, checked)


def run_job(models, ranks, mode, timeout=90, port=None, rank0_hosts=False, target=None, models_arg=None):
    """Runs `ranks` as spawned processes. The TCPStore lives in this process (as torchrun's agent
    or a Ray driver would host it), or on rank 0 with rank0_hosts."""
    for k, v in UCX_ENV.items():
        os.environ.setdefault(k, v)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    host = None
    if port is None and rank0_hosts:
        port = (free_port(), True)
    elif port is None:
        host = torch.distributed.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                                          wait_for_workers=False)
        port = (host.port, False)
    if target is None:
        procs = {r: ctx.Process(target=worker, args=(r, port, models, mode, q)) for r in ranks}
    else:
        procs = {r: ctx.Process(target=target, args=(r, port, models_arg or models, q)) for r in ranks}
    for p in procs.values():
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < len(ranks) and time.monotonic() < deadline:
            try:
                res = q.get(timeout=1)
                results[res[0]] = res
            except queue.Empty:
                if all(not p.is_alive() for p in procs.values()) and q.empty():
                    break
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return results, {r: p.exitcode for r, p in procs.items()}


def test_two_refits_across_processes(models):
    src, dst = layouts(models)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    results, codes = run_job(models, ranks, "ok", rank0_hosts=True)  # close() lets the host leave safely
    assert set(results) == set(ranks), (results, codes)
    for r, res in results.items():
        assert res[1] == "ok", res
        reports = res[2]
        assert [x["version"] for x in reports] == [1, 2]
        if r in dst.ranks:
            assert res[3] > 0
    sent = sum(res[2][1]["bytes_moved"] for res in results.values())
    assert sent == reshard.plan(src, dst).stats["bytes"]


def test_double_buffered(models):
    """Each refit writes the set not served and publishes it whole: inference reads serving_set."""
    src, dst = layouts(models)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    results, codes = run_job(models, ranks, "double")
    assert set(results) == set(ranks), (results, codes)
    for res in results.values():
        assert res[1] == "ok", res
    assert results[2][3] > 0


def test_colocated_ranks_local_copies(examples):
    """Every process on both sides: local copies and network copies in one refit over UCX."""
    src = reshard.read_layout(examples / "colocated" / "train.json")
    results, codes = run_job(examples, src.ranks, None, target=colocated_worker)
    assert set(results) == set(src.ranks), (results, codes)
    for res in results.values():
        assert res[1] == "ok", res
        assert res[3] > 0
    assert sum(res[2][0]["local_bytes"] for res in results.values()) > 0


def test_any_store_with_set_and_get(models):
    """The rendezvous over a plain key-value object (no TCPStore, no check(), no add())."""
    src, dst = layouts(models)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    with mp.get_context("spawn").Manager() as m:
        results, codes = run_job(models, ranks, "ok", port=m.dict())
    assert set(results) == set(ranks), (results, codes)
    for res in results.values():
        assert res[1] == "ok", res
        assert [x["version"] for x in res[2]] == [1, 2]


def test_peer_dies_mid_job(models):
    src, dst = layouts(models)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    results, codes = run_job(models, ranks, "dies")
    assert codes[2] == 3
    for r in (0, 1):
        res = results[r]
        assert res[1] == "error", res
        assert "rank 2" in res[3], res[3]
        assert res[4] < 30, f"rank {r} took {res[4]:.1f} s to notice"


def test_rank_never_arrives(models):
    results, codes = run_job(models, [0, 1], "ok")
    for r in (0, 1):
        res = results[r]
        assert res[1] == "error", res
        assert "rank 2 never arrived" in res[3], res[3]
        assert res[4] < 30


def test_bad_buffer_fails_every_rank(models):
    src, dst = layouts(models)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    results, codes = run_job(models, ranks, "bad")
    assert "dtype f32 but the layout stores bf16" in results[1][3]
    for r in (0, 2):
        res = results[r]
        assert res[1] == "error", res
        assert "rank 1 failed to set up" in res[3] and "dtype f32" in res[3], res[3]
        assert res[4] < 30


@pytest.mark.parametrize("double,strided", [(False, False), (True, False), (False, True)],
                         ids=["single", "double-buffered", "strided"])
def test_delta_refits(models, double, strided):
    """Only changed elements move after the first refit; every element is checked against the oracle after
    each version, a destination overwritten by someone else included (its rank alone asks for a dense refit)."""
    src, dst = layouts(models)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    results, codes = run_job(models, ranks, None, target=functools.partial(delta_worker, double=double, strided=strided))
    assert set(results) == set(ranks), (results, codes)
    for res in results.values():
        assert res[1] == "ok", res
    assert results[2][3] > 0
    per_version = [[res[2][k]["delta"] for res in results.values()] for k in range(len(DELTA_MODES))]
    modes = [d[0]["mode"] for d in per_version]
    assert all(x["mode"] == m for d, m in zip(per_version, modes) for x in d), per_version  # every rank alike
    sent = [sum(res[2][k]["bytes_moved"] for res in results.values()) for k in range(len(DELTA_MODES))]
    dense = reshard.plan(src, dst).stats["bytes"]
    assert sent[0] == dense
    if double:
        # Each set primes once; then a set's refit diffs against the version before last (the one
        # it holds). The overwrite makes both sets' next refit dense.
        assert modes[:3] == ["prime", "prime", "delta"] and "delta" not in modes[3:5], modes
        assert sent[2] < dense * 0.1, (sent, dense)
        return
    assert modes == DELTA_MODES, modes
    for k, m in enumerate(modes):
        if m == "delta":
            fraction = DELTA_VERSIONS[k - 1][0]
            assert sent[k] < dense * (0.05 + 4 * fraction), (k, sent[k], dense)
            assert abs(per_version[k][0]["changed_fraction"] - fraction) <= 0.002 + fraction * 0.1, per_version[k][0]
    assert results[0][2][1]["delta"]["shadow_bytes"] > 0
    assert results[0][2][1]["delta"]["payload_bytes"] < results[0][2][0]["bytes_moved"] // 20


# Casts with delta refits: an f32 master copy (Adam at lr 1e-6) refit into bf16 vLLM buffers with
# cast=True and delta=True. The embedding is bf16 on both sides (not cast); every other tensor is cast
# f32 -> bf16 (the norms too, as vLLM holds them: at 1.0 a step of lr leaves their bf16 value). Steps
# 1-5 are Adam steps at lr 1e-6; before step 4 the last destination rank overwrites its buffers and asks
# for a dense refit; step 6 is a step at lr 1e-2 (every bf16 value changes: the dense fallback).
CAST_DELTA_LR = [1e-6, 1e-6, 1e-6, 1e-6, 1e-6, 1e-2]
CAST_DELTA_MODES = ["prime", "delta", "delta", "delta", "dense", "delta", "dense"]


def master_layouts(models):
    """tiny-llama Megatron tp=2 holding an f32 master (its embedding bf16) -> vLLM tp=2 in bf16."""
    cfg = models / "tiny-llama.json"
    src = json.loads(reshard.megatron_layout(cfg, "tp=2").to_json())
    dst = json.loads(reshard.vllm_layout(cfg, "tp=2", first_rank=2).to_json())
    for t in src["tensors"]:
        t["dtype"] = "bf16" if "embed" in t["name"] else "f32"
    return reshard.layout_from_json(src, "f32 master"), reshard.layout_from_json(dst, "bf16 engine")


class AdamMaster:
    """Full f32 master tensors and Adam (beta1 0.9, beta2 0.999, eps 1e-8, bias-corrected): N(0, 0.02)
    weights (norms 1.0); step k takes lr CAST_DELTA_LR[k - 1] and a fresh N(0, 1e-6) gradient per element.
    Every process computes the same (one seeded generator, the same torch ops)."""

    def __init__(self, layout):
        self.g = torch.Generator().manual_seed(77)
        self.w = {n: torch.ones(layout.tensor(n)["shape"]) if "norm" in n
                  else 0.02 * torch.randn(layout.tensor(n)["shape"], generator=self.g) for n in sorted(layout.tensors)}
        self.m = {n: torch.zeros_like(w) for n, w in self.w.items()}
        self.v = {n: torch.zeros_like(w) for n, w in self.w.items()}
        self.k = 0

    def step(self):
        self.k += 1
        lr, k = CAST_DELTA_LR[self.k - 1], self.k
        for n, w in self.w.items():
            grad = 1e-3 * torch.randn(w.shape, generator=self.g)
            self.m[n].mul_(0.9).add_(grad, alpha=0.1)
            self.v[n].mul_(0.999).addcmul_(grad, grad, value=0.001)
            w -= lr * (self.m[n] / (1 - 0.9 ** k)) / ((self.v[n] / (1 - 0.999 ** k)).sqrt() + 1e-8)


def bit_check(got, expected, where):
    """Every real slot equal bit for bit (the oracle's check compares values: -0.0 == 0.0)."""
    for name, (v, m) in expected.items():
        ints = {2: torch.int16, 4: torch.int32}[v.element_size()]
        g = got[name].reshape(v.shape)
        assert g.dtype == v.dtype, f"{where}: {name} is {g.dtype}, expected {v.dtype}"
        bad = (g.view(ints) != v.view(ints)) & m
        assert not bad.any(), f"{where}: {name}: {int(bad.sum())} elements differ bit for bit"


def delta_cast_worker(rank, port, models, q):
    with RankOutcome(rank, q) as outcome:
        torch.set_num_threads(1)
        store = torch.distributed.TCPStore("127.0.0.1", port[0], None, False, timeout=datetime.timedelta(seconds=60))
        src, dst = master_layouts(models)
        cfg = json.loads((models / "tiny-llama.json").read_text())

        def held(master):  # this source rank's pieces of the master (the embedding as bf16)
            typed = {n: w.to(reshard.torch_dtype(src.tensor(n)["dtype"])) for n, w in master.items()}
            return {n: x for n, (x, _) in oracle.contract_buffers(src, typed, rank).items()}

        adam = AdamMaster(src)
        bufs = {n: x.clone() for n, x in held(adam.w).items()} if rank in src.ranks else {}
        if rank in dst.ranks:
            bufs.update(reshard.allocate(dst, rank, fill=POISON))
        r = reshard.Resharder(src, dst, rank=rank, buffers=bufs, store=store, stall_timeout=10, delta=True, cast=True)
        reports, checked = [], 0
        for step in range(len(CAST_DELTA_LR) + 1):
            if step:
                adam.step()
            master = adam.w
            if step and rank in src.ranks:
                for n, x in held(master).items():
                    bufs[n].copy_(x)
            if step == 4 and rank == dst.ranks[-1]:
                for t in bufs.values():
                    t.fill_(POISON)
                r.invalidate_delta_base()  # this rank alone
            rep = r.refit()
            reports.append(rep)
            if rank in dst.ranks:
                # The reference: torch's own conversion of the full master, sliced as vLLM holds it.
                want = {n: w.to(reshard.torch_dtype(dst.tensor(n)["dtype"])) for n, w in master.items()}
                expected = oracle.vllm_llama_buffers(cfg, want, 2, 2, rank)
                where = f"step {step} ({rep['delta']['mode']})"
                checked += oracle.check(bufs, expected, POISON, where)
                bit_check(bufs, expected, where)
        r.close()
        outcome.ok(reports, checked)


def test_delta_cast_refits_send_only_the_changed_bf16_values(models):
    """An f32 master refit into bf16 with delta=True and cast=True: bit-exact against torch's conversion of
    the full master after every step; after Adam's first step at most 1/20 of the dense bytes cross; the
    invalidated step and the lr 1e-2 step go dense and stay exact."""
    src, dst = master_layouts(models)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    results, codes = run_job(models, ranks, None, timeout=180, target=delta_cast_worker)
    assert set(results) == set(ranks), (results, codes)
    for res in results.values():
        assert res[1] == "ok", res
    assert results[2][3] > 0 and results[3][3] > 0
    modes = [results[0][2][k]["delta"]["mode"] for k in range(len(CAST_DELTA_MODES))]
    assert modes == CAST_DELTA_MODES, modes
    sent = [sum(res[2][k]["bytes_moved"] for res in results.values()) for k in range(len(modes))]
    payload = [sum(res[2][k]["delta"]["payload_bytes"] for res in results.values()) for k in range(len(modes))]
    dense = reshard.plan(src, dst, cast=True).stats["bytes"]  # the destination's dtype, bf16
    assert sent[0] == dense
    # The shadows hold what the receivers hold: bf16, not the master's f32 (sources send every byte once).
    assert sum(results[r][2][1]["delta"]["shadow_bytes"] for r in src.ranks) == dense
    for k, m in enumerate(modes):
        print(f"step {k} ({m}): {sent[k]} of {dense} dense bytes sent ({sent[k] / dense:.4f}), payload {payload[k]} "
              f"({payload[k] / dense:.4f}), changed {results[0][2][k]['delta']['changed_fraction']}")
        if m == "delta":
            # Adam's first step moves every weight by exactly lr; from its second on, at most 1/20 of
            # the payload bytes. (What crosses also rounds each pair's payload up to 64 KiB blocks.)
            assert payload[k] * (10 if k == 1 else 20) <= dense, (k, payload[k], dense)
            assert sent[k] <= payload[k] + 2 * 65536 * 2 * len(src.ranks), (k, sent[k], payload[k])


def test_delta_options_are_checked(models):
    src, dst = layouts(models)
    with pytest.raises(reshard.Error, match="delta is off"):
        reshard.Resharder(src, dst, rank=0, buffers={}, store=DictStore({}), dense_above=0.1)
    with pytest.raises(reshard.Error, match=r"dense_above must be a fraction in \[0, 1\]; got 2"):
        reshard.Resharder(src, dst, rank=0, buffers={}, store=DictStore({}), delta=True, dense_above=2)


# A destination killed in the middle of a refit (issue 53): the surviving destination's RefitNotCommitted
# says, buffer by buffer, what its memory holds (CONTRACT.md §5). A model big enough (about 60 MB) that
# the refit is still moving when the timer fires.
MID_REFIT_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
                    "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
                    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8000, "tie_word_embeddings": False,
                    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-06}


def killed_mid_refit_worker(rank, port, cfg_path, q, delay):
    """Ranks 0-1 Megatron tp=2, 2-3 vLLM tp=2; version 1 commits; rank 3 kills itself `delay` s into version
    2's refit. The survivors report their error and, on rank 2, what each buffer holds against both versions."""
    t0 = time.monotonic()
    try:
        import threading

        store = torch.distributed.TCPStore("127.0.0.1", port[0], None, False, timeout=datetime.timedelta(seconds=60))
        src = reshard.megatron_layout(cfg_path, "tp=2")
        dst = reshard.vllm_layout(cfg_path, "tp=2", first_rank=2)
        cfg = json.loads(pathlib.Path(cfg_path).read_text())
        full1, full2 = oracle.full_tensors(src, seed=31), oracle.full_tensors(src, seed=32)
        bufs = ({n: v.clone() for n, (v, _) in oracle.contract_buffers(src, full1, rank).items()} if rank < 2
                else reshard.allocate(dst, rank, fill=POISON))
        r = reshard.Resharder(src, dst, rank=rank, buffers=bufs, transport="ucx", store=store, stall_timeout=10)
        r.refit()
        if rank < 2:
            for n, (v, _) in oracle.contract_buffers(src, full2, rank).items():
                bufs[n].copy_(v)
        if rank == 3:
            threading.Timer(delay, lambda: os.kill(os.getpid(), 9)).start()
        t0 = time.monotonic()
        try:
            r.refit()
        except reshard.RefitNotCommitted as e:
            held = None
            if rank == 2:
                held = what_each_buffer_holds(bufs, oracle.vllm_llama_buffers(cfg, full1, 2, 2, rank),
                                              oracle.vllm_llama_buffers(cfg, full2, 2, 2, rank))
            q.put((rank, "not committed", str(e), (list(e.written), list(e.partial), list(e.untouched)), held,
                   time.monotonic() - t0))
            return
        q.put((rank, "committed", None, None, None, time.monotonic() - t0))
    except reshard.Error as e:
        q.put((rank, "error", f"{type(e).__name__}: {e}", None, None, time.monotonic() - t0))
    except BaseException:
        q.put((rank, "crash", traceback.format_exc(), None, None, None))


def what_each_buffer_holds(got, v1, v2):
    """Per buffer, from its memory alone: "written" (every element of version 2), "untouched" (every element
    of version 1) or "partial" (each element of one of them, some of each); anything else is named."""
    out = {}
    for name, (a, m) in v1.items():
        b, _ = v2[name]
        g = got[name].reshape(a.shape)[m]
        a, b = a[m], b[m]
        new, old = (g == b), (g == a)
        if not (new | old).all():
            out[name] = f"{int((~(new | old)).sum())} elements of neither version"
        else:
            out[name] = "written" if new.all() else "untouched" if old.all() else "partial"
    return out


@pytest.mark.parametrize("delay", [0.0, 0.05], ids=["at-once", "50ms-in"])
def test_destination_killed_mid_refit_survivor_names_what_it_holds(tmp_path, delay):
    cfg = tmp_path / "llama-60mb.json"
    cfg.write_text(json.dumps(MID_REFIT_CONFIG))
    results, codes = run_job(None, [0, 1, 2, 3], None, target=functools.partial(killed_mid_refit_worker, delay=delay),
                             models_arg=str(cfg), timeout=120)
    assert codes[3] == -9, codes
    assert set(results) == {0, 1, 2}, (results, codes)
    for rank, res in results.items():
        assert res[1] == "not committed", res
        assert "rank 3" in res[2] and res[5] < 30, res
        for wrong in ("stale", "not updated"):
            assert wrong not in res[2], res[2]
    written, partial, untouched = results[2][3]
    assert written or partial, "the refit was not under way when the destination died"
    held = results[2][4]
    # Every buffer named once, and named as its memory says, element by element (a buffer named partial
    # may hold either version throughout: a posted receive may or may not have landed).
    assert sorted(written + partial + untouched) == sorted(held), (written, partial, untouched, held)
    for n in written:
        assert held[n] == "written", (n, held[n])
    for n in untouched:
        assert held[n] == "untouched", (n, held[n])
    for n in partial:
        assert held[n] in ("written", "untouched", "partial"), (n, held[n])
    assert all(n in results[2][2] for n in (written + partial)[:3]), results[2][2]
    # The source ranks have no destination buffers.
    assert results[0][3] == ([], [], []) and results[1][3] == ([], [], [])
