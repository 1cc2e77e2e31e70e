"""A Resharder's life outside the happy path (issue 39): dropped without close() while its peers are
busy, rank threads of one process sharing one store client, and the README's snippet run with
warnings as errors (no warning, no nanobind leak line)."""
import datetime
import gc
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
import traceback

import pytest
import torch

import oracle
import reshard
from test_multiprocess import POISON, UCX_ENV, run_job, tiny_llama_rank

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
ucx_only = pytest.mark.skipif(not reshard.has_ucx, reason="reshard built without UCX")


def drop_worker(rank, port, models, q):
    """Two refits, every element checked; then the sources drop their Resharder without close() while
    the destinations sit in Python for 3 s (no UCX progress), then drop theirs. A ticker thread counts
    while the drop runs: the drop must not hold the GIL."""
    t0 = time.monotonic()
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port[0], None, False, timeout=datetime.timedelta(seconds=60))
        src, dst, cfg, full, bufs = tiny_llama_rank(models, rank, seed=41)
        r = reshard.Resharder(src, dst, rank=rank, buffers=bufs, store=store, stall_timeout=10)
        checked = 0
        for k in range(2):
            full = oracle.full_tensors(src, seed=41 + k)
            if rank in src.ranks:
                for n, (v, _) in oracle.contract_buffers(src, full, rank).items():
                    bufs[n].copy_(v)
            r.refit()
            if rank in dst.ranks:
                checked += oracle.check(bufs, oracle.vllm_llama_buffers(cfg, full, 1, len(src.ranks), rank), POISON,
                                        f"refit {k}")
        if rank in dst.ranks:
            time.sleep(3)  # busy in Python: this rank's UCX makes no progress
        ticks, stop = [0], threading.Event()

        def tick():
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.01)

        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(0.05)
        before = ticks[0]
        d0 = time.monotonic()
        del r
        gc.collect()
        drop_s = time.monotonic() - d0
        during = ticks[0] - before
        stop.set()
        ticker.join()
        q.put((rank, "ok", {"drop_seconds": drop_s, "ticks_during_drop": during}, checked, time.monotonic() - t0))
    except reshard.Error as e:
        q.put((rank, "error", type(e).__name__, str(e), time.monotonic() - t0))
    except BaseException:
        q.put((rank, "crash", traceback.format_exc(), None, None))


@ucx_only
def test_dropped_resharder_while_peers_busy_exits_cleanly(models):
    src, dst = reshard.megatron_layout(models / "tiny-llama.json", "tp=2"), None
    dst = reshard.vllm_layout(models / "tiny-llama.json", "tp=1", first_rank=len(src.ranks))
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    results, codes = run_job(models, ranks, None, target=drop_worker, timeout=120)
    assert codes == {r: 0 for r in ranks}, f"exit codes {codes} (-6: SIGABRT in ucp_worker_destroy); results {results}"
    for r in ranks:
        assert results[r][1] == "ok", results[r]
        if r in dst.ranks:
            assert results[r][3] > 0
    for r in src.ranks:  # the sources dropped theirs while the destinations slept
        info = results[r][2]
        if info["drop_seconds"] > 0.3:
            assert info["ticks_during_drop"] >= 5, f"rank {r}: the drop held the GIL: {info}"


def _rank_thread(rank, store, models, out):
    try:
        src, dst, cfg, full, bufs = tiny_llama_rank(models, rank, seed=51)
        with reshard.Resharder(src, dst, rank=rank, buffers=bufs, store=store, stall_timeout=10) as r:
            r.refit()
        checked = 0
        if rank in dst.ranks:
            checked = oracle.check(bufs, oracle.vllm_llama_buffers(cfg, full, 1, len(src.ranks), rank), POISON, "refit")
        out[rank] = ("ok", checked)
    except BaseException:
        out[rank] = ("crash", traceback.format_exc())


@ucx_only
def test_rank_threads_share_one_store_client(models):
    """Three ranks as threads of this process, one TCPStore client between them, two jobs in a row:
    rank R's k-th Resharder on a store meets the k-th of the other ranks (counted per rank, not per process)."""
    for k, v in UCX_ENV.items():
        os.environ.setdefault(k, v)
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                                       wait_for_workers=False)
    src = reshard.megatron_layout(models / "tiny-llama.json", "tp=2")
    ranks = list(range(len(src.ranks) + 1))
    for job in range(2):
        out = {}
        threads = [threading.Thread(target=_rank_thread, args=(r, store, models, out)) for r in ranks]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert {r: out.get(r, ("hung",))[0] for r in ranks} == {r: "ok" for r in ranks}, f"job {job}: {out}"
        assert out[ranks[-1]][1] > 0
        assert time.monotonic() - t0 < 10, "the ranks waited for each other: the store keys disagreed"


def readme_python_snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Python"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("alive_at_exit", ["snippet", "more"])
def test_readme_snippet_prints_no_warning_and_no_leak(alive_at_exit):
    """The README's Python snippet, as a user runs it, with UserWarnings as errors: it must succeed and
    print nothing on stderr (no torch warning, no 'nanobind: leaked' line). 'more' keeps more of the
    package's objects alive at exit: a plan, per-rank schedules, a layout from a preset, numpy buffers."""
    code = readme_python_snippet()
    if alive_at_exit == "more":
        code += ("\nimport numpy\nsched = reshard.plan(train, infer)\nper_rank = [reshard.plan(train, infer, r) for r in (0, 8)]\n"
                 f"preset = reshard.megatron_layout({str(REPO / 'examples' / 'models' / 'tiny-llama.json')!r}, 'tp=2')\n"
                 "small = reshard.layout_from_json({'mesh': {'axes': [['tp', 2]]}, 'tensors': [{'name': 'w', 'shape': [4, 2], "
                 "'dtype': 'f32', 'dims': ['tp', None]}]})\n"
                 "npbufs = reshard.allocate(small, 0, 'numpy')\nspecs = reshard.buffer_specs(preset, 1)\n")
    res = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "leaked" not in res.stderr and "leaked" not in res.stdout, res.stderr
    assert res.stderr.strip() == "", res.stderr
    assert "1708 bytes moved" in res.stdout  # the snippet's refit ran (it checks every element itself)


@ucx_only
def test_close_with_rank0_hosting_the_store_prints_nothing(models, capfd):
    """Rank 0 hosts the TCPStore and exits as soon as its close() returns; every rank's close() ends
    cleanly, and no process prints c10d's 'recvValue failed' trace (a rank polling the store while
    its host exits), three jobs in a row."""
    from test_multiprocess import layouts

    src, dst = layouts(models)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    for job in range(3):
        results, codes = run_job(models, ranks, "ok", rank0_hosts=True)
        assert codes == {r: 0 for r in ranks}, (job, codes, results)
        assert all(results[r][1] == "ok" for r in ranks), (job, results)
        err = capfd.readouterr().err
        assert "recvValue" not in err and "Traceback" not in err, f"job {job}:\n{err}"


def test_store_server_is_told_from_its_clients():
    """close() keeps the process hosting the TCPStore until every client's last request was answered, so it
    must tell that process (the listening socket is one of its descriptors) from a client in another
    process, also through a PrefixStore; a store with no server (HashStore) has no host."""
    from reshard import _serves_store

    host = torch.distributed.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                                      wait_for_workers=False)
    assert _serves_store(host)
    assert _serves_store(torch.distributed.PrefixStore("job", host))
    assert not _serves_store(torch.distributed.HashStore())
    code = ("import datetime, torch.distributed as d\nfrom reshard import _serves_store\n"
            f"c = d.TCPStore('127.0.0.1', {host.port}, None, False, timeout=datetime.timedelta(seconds=30))\n"
            "print(_serves_store(c), _serves_store(d.PrefixStore('job', c)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"], res.stdout
