"""CUDA tensors from Python (reshard.has_cuda: the module built where nvcc was found).

Without a GPU (this file's first half): tensors that say they are CUDA memory through DLPack
(a hand-made DLPack producer, since torch makes no CUDA tensor without a device) are accepted by
the checks and fail with one clear error where a GPU is needed, on every rank, never a crash; a
rank mixing host and CUDA tensors, and stream arguments for host tensors, are refused by name.

With a GPU (the second half, skipped here; bench/gpu_check.sh runs it): refits of CUDA tensors
against the contract oracle (torch ops on the full tensors), ordered with the caller's stream.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

import oracle
import reshard

POISON = -7.0
GPU = torch.cuda.is_available()


# --- a DLPack producer of "CUDA" tensors, for machines without a GPU ----------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_DL_CODES = {torch.float32: (2, 32), torch.bfloat16: (4, 16), torch.float16: (2, 16), torch.int32: (0, 32)}


class LabelledCuda:
    """A host tensor's memory exported through DLPack as CUDA device memory (device type 2): what a
    CUDA tensor looks like to reshard's checks. Its pointer is host memory, so nothing may touch it
    as device memory: only for machines without a GPU, where reshard must stop before that."""

    def __init__(self, t: torch.Tensor, device_id: int = 0) -> None:
        self.t = t.contiguous()
        self.device_id = device_id
        self._keep = []

    def __dlpack_device__(self):
        return (2, self.device_id)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        code, bits = _DL_CODES[self.t.dtype]
        shape = (ctypes.c_int64 * self.t.dim())(*self.t.shape)
        m = _DLManagedTensor()
        m.dl_tensor.data = self.t.data_ptr()
        m.dl_tensor.device = _DLDevice(2, self.device_id)
        m.dl_tensor.ndim = self.t.dim()
        m.dl_tensor.dtype = _DLDataType(code, bits, 1)
        m.dl_tensor.shape = shape
        m.dl_tensor.strides = None
        m.dl_tensor.byte_offset = 0
        m.deleter = None
        self._keep += [shape, m]
        return _capsule_new(ctypes.addressof(m), b"dltensor", None)


def _pair(examples, name):
    return (reshard.read_layout(examples / name / "train.json"), reshard.read_layout(examples / name / "infer.json"))


def _block(examples):
    src, dst = _pair(examples, "llama-block")
    full = oracle.full_tensors(src, seed=8)
    return src, dst, full, oracle.refit_buffers(src, dst, full, POISON)


QKV = "model.layers.0.self_attn.qkv_proj.weight"


def test_has_cuda_is_a_bool():
    assert reshard.has_cuda in (True, False)
    assert "has_cuda" in reshard.__all__


@pytest.mark.skipif(GPU, reason="labelled host memory must not reach a real GPU")
def test_cuda_tensors_without_a_gpu_fail_clearly(examples):
    src, dst, _, bufs = _block(examples)
    for r in dst.ranks:
        bufs[r]["dst"] = {n: LabelledCuda(t) for n, t in bufs[r]["dst"].items()}
    want = r"this process sees 0 CUDA device\(s\)" if reshard.has_cuda else "has no CUDA copy engine"
    with pytest.raises(reshard.Error, match=want):
        reshard.refit_local(src, dst, bufs)
    # The destinations were never written.
    for r in dst.ranks:
        for lc in bufs[r]["dst"].values():
            assert (lc.t == POISON).all()


def test_a_rank_mixing_host_and_cuda_tensors_is_refused(examples):
    src, dst, _, bufs = _block(examples)
    host = bufs[8]["dst"][QKV]
    bufs[8]["dst"][QKV] = host.cuda() if GPU else LabelledCuda(host)
    if reshard.has_cuda:
        match = rf"rank 8: destination buffer '{QKV}' is in cuda:0, but rank 8: destination buffer '.*' is in host memory"
        if list(bufs[8]["dst"]).index(QKV) == 0:
            match = rf"is in host memory, but rank 8: destination buffer '{QKV}' is in cuda:0"
    else:
        match = "has no CUDA copy engine"
    with pytest.raises(reshard.Error, match=match):
        reshard.refit_local(src, dst, bufs)


def test_cuda_tensors_on_two_gpus_in_one_rank_are_refused(examples):
    if not reshard.has_cuda:
        pytest.skip("this build takes host tensors only")
    if GPU and torch.cuda.device_count() < 2:
        pytest.skip("one GPU: a real second device is needed, and labelled host memory must not reach the first")
    src, dst, _, bufs = _block(examples)
    names = list(bufs[8]["dst"])
    for i, n in enumerate(names):
        t = bufs[8]["dst"][n]
        bufs[8]["dst"][n] = t.to(f"cuda:{i % 2}") if GPU else LabelledCuda(t, device_id=i % 2)
    with pytest.raises(reshard.Error, match=r"is in cuda:1, but rank 8: destination buffer '.*' is in cuda:0: a rank's tensors "
                                            r"must all be in host memory or all on one GPU"):
        reshard.refit_local(src, dst, bufs)


def test_stream_arguments_for_host_tensors_are_refused(examples):
    src, dst, _, bufs = _block(examples)
    with pytest.raises(reshard.Error, match="a stream orders CUDA tensors; these are host memory"):
        reshard.refit_local(src, dst, bufs, stream=0)


@pytest.mark.skipif(not reshard.has_ucx, reason="no UCX transport")
def test_resharder_stream_arguments_for_host_tensors_are_refused(examples):
    src, dst = _pair(examples, "colocated")
    full = oracle.full_tensors(src, seed=3)
    bufs = oracle.refit_buffers(src, dst, full, POISON)
    store = _ThreadStore()
    rs, errors = {}, []

    def rank(r):
        try:
            rs[r] = reshard.Resharder(src, dst, r, bufs[r], store=store, prefix="host-order", ucx_config={"TLS": "tcp,self"})
            with pytest.raises(reshard.Error, match="order CUDA tensors; this rank's tensors are host memory"):
                rs[r].refit(wait=True)  # refused before any rank starts the collective
            rs[r].refit()
            rs[r].close()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(f"rank {r}: {e}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in src.ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for r in dst.ranks:
        oracle.check(bufs[r]["dst"], oracle.contract_buffers(dst, full, r), POISON, f"rank {r}")


class _ThreadStore:
    """set / get over a dict, for rank threads of one process (KeyError when missing)."""

    def __init__(self):
        self.d = {}
        self.lock = threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.d[key] = value

    def get(self, key):
        with self.lock:
            return self.d[key]


@pytest.mark.skipif(GPU or not reshard.has_ucx, reason="labelled host memory must not reach a real GPU / no UCX")
def test_resharder_with_cuda_tensors_and_no_gpu_fails_every_rank(examples):
    """A rank whose CUDA tensors cannot be served fails its constructor, and so does every other rank
    (naming that rank), instead of waiting for it."""
    src, dst = _pair(examples, "colocated")
    full = oracle.full_tensors(src, seed=3)
    bufs = oracle.refit_buffers(src, dst, full, POISON)
    bufs[0]["src"] = {n: LabelledCuda(t) for n, t in bufs[0]["src"].items()}
    bufs[0]["dst"] = {n: LabelledCuda(t) for n, t in bufs[0]["dst"].items()}
    store = _ThreadStore()
    errors = {}

    def rank(r):
        try:
            reshard.Resharder(src, dst, r, bufs[r], store=store, prefix="no-gpu", ucx_config={"TLS": "tcp,self"}, stall_timeout=20)
        except reshard.Error as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in src.ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(errors) == list(src.ranks), errors
    why = r"sees 0 CUDA device\(s\)" if reshard.has_cuda else "has no CUDA copy engine"
    import re

    assert re.search(why, errors[0]), errors[0]
    for r in src.ranks[1:]:
        assert "rank 0 failed to set up" in errors[r] and re.search(why, errors[r]), errors[r]


# --- on a GPU ------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not (GPU and reshard.has_cuda), reason="needs a CUDA device and a build with the CUDA copy engine")


def _to_cuda(bufs):
    return {r: {side: {n: t.cuda() for n, t in v.items()} for side, v in b.items()} for r, b in bufs.items()}


@gpu
@pytest.mark.parametrize("name", ["llama-block", "colocated", "moe-experts"])
def test_refit_local_cuda_every_element(examples, name):
    src, dst = _pair(examples, name)
    full = oracle.full_tensors(src, seed=5)
    bufs = _to_cuda(oracle.refit_buffers(src, dst, full, POISON))
    rep = reshard.refit_local(src, dst, bufs, iterations=2)
    assert rep["bytes_moved"] + rep["local_bytes"] > 0
    for r in dst.ranks:
        got = {n: t.cpu() for n, t in bufs[r]["dst"].items()}
        oracle.check(got, oracle.contract_buffers(dst, full, r), POISON, f"{name} rank {r}")


@gpu
def test_refit_local_waits_for_the_callers_stream(examples):
    """The sources are written by work still queued on the caller's stream (behind a long sleep)
    when refit_local is called: the refit must read what that work writes, not the stale values."""
    src, dst = _pair(examples, "llama-block")
    full = oracle.full_tensors(src, seed=6)
    truth = _to_cuda(oracle.refit_buffers(src, dst, full, POISON))
    bufs = {r: {"src": {n: torch.full_like(t, 3.0) for n, t in b["src"].items()}, "dst": b["dst"]} for r, b in truth.items()}
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the sources become final
        for r, b in bufs.items():
            for n, t in b["src"].items():
                t.copy_(truth[r]["src"][n])
        reshard.refit_local(src, dst, bufs)  # ordered after `side`, the current stream
    torch.cuda.synchronize()
    for r in dst.ranks:
        oracle.check({n: t.cpu() for n, t in bufs[r]["dst"].items()}, oracle.contract_buffers(dst, full, r), POISON, f"rank {r}")


def cuda_ipc_worker(rank, port, examples, q):
    """A process of a colocated job on the one GPU: its CUDA tensors refit through UCX (cuda_ipc
    between processes sharing the GPU), twice, the second after new sources are written on the
    current stream without a host wait (the refit orders itself after that stream)."""
    import datetime
    import time
    import traceback

    t0 = time.monotonic()
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port[0], None, False, timeout=datetime.timedelta(seconds=60))
        src, dst = _pair(examples, "colocated")
        checked = 0
        full = oracle.full_tensors(src, seed=31)
        bufs = {"src": {n: v.clone().cuda() for n, (v, _) in oracle.contract_buffers(src, full, rank).items()},
                "dst": {n: t.cuda() for n, t in reshard.allocate(dst, rank, fill=POISON).items()}}
        with reshard.Resharder(src, dst, rank=rank, buffers=bufs, store=store, stall_timeout=20) as r:
            reps = [r.refit()]
            checked += oracle.check({n: t.cpu() for n, t in bufs["dst"].items()}, oracle.contract_buffers(dst, full, rank), POISON,
                                    f"rank {rank} refit 1")
            full2 = oracle.full_tensors(src, seed=32)
            torch.cuda._sleep(100_000_000)
            for n, (v, _) in oracle.contract_buffers(src, full2, rank).items():
                bufs["src"][n].copy_(v, non_blocking=True)
            reps.append(r.refit())
            checked += oracle.check({n: t.cpu() for n, t in bufs["dst"].items()}, oracle.contract_buffers(dst, full2, rank), POISON,
                                    f"rank {rank} refit 2")
        q.put((rank, "ok", reps, checked, time.monotonic() - t0))
    except reshard.Error as e:
        q.put((rank, "error", type(e).__name__, str(e), time.monotonic() - t0))
    except BaseException:
        q.put((rank, "crash", traceback.format_exc(), None, None))


@gpu
@pytest.mark.skipif(not reshard.has_ucx, reason="no UCX transport")
def test_processes_sharing_the_gpu_refit_over_ucx(examples, monkeypatch):
    info = reshard.ucx_info()
    if not info["cuda"]:
        pytest.skip(f"{info['summary']}: build reshard against the libucx-cu13 wheel (docs/python.md)")
    from test_multiprocess import run_job

    monkeypatch.setenv("UCX_TLS", "tcp,self,sm,cuda_copy,cuda_ipc")  # (run_job's default has no CUDA transports)
    src = reshard.read_layout(examples / "colocated" / "train.json")
    results, codes = run_job(examples, src.ranks, None, target=cuda_ipc_worker, timeout=180)
    assert set(results) == set(src.ranks), (results, codes)
    for res in results.values():
        assert res[1] == "ok", res
        assert res[3] > 0
        assert [x["version"] for x in res[2]] == [1, 2] and res[2][0]["device"] == "cuda:0"
