"""One process of an RL-style loop through vLLM's weight-transfer API with the "reshard" backend.

  backend_worker.py trainer --rank R   an FSDP2 HuggingFace Llama on gloo taking SGD steps on a toy loss;
                                       WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo,
                                       source=vLLM's ModuleSource), send_weights() every step
  backend_worker.py vllm --rank R      a live vLLM model (CPU recipe) whose engine comes from
                                       WeightTransferEngineFactory.create_engine(WeightTransferConfig(
                                       backend="reshard")), driven through its four phases by the
                                       trainer's client

The client (CommandClient) is vLLM's VLLMWeightSyncClient protocol over a TCPStore the test hosts: each
call posts a command every vLLM rank executes on its engine, and waits for all their answers. After
each published version every vLLM rank compares every parameter, bit for bit, with vLLM's own
load_weights of the trainer's full state dict (gathered with full_tensor(), saved by trainer rank 0).
With --kill-at K trainer rank 1 dies before step K's update: the update must fail on every rank, naming
the dead rank, and the engines must not publish it.
"""
import argparse
import datetime
import json
import os
import pathlib
import sys
import threading
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import oracle  # noqa: E402
import reshard  # noqa: E402


class CommandClient:
    """vLLM's VLLMWeightSyncClient over a TCPStore: post a command, wait for every vLLM rank's answer."""

    def __init__(self, store, ranks, timeout=120.0):
        self.store, self.ranks, self.timeout, self.k = store, ranks, timeout, 0

    def call(self, method, arg=None):
        self.k += 1
        self.store.set(f"cmd/{self.k}", json.dumps({"method": method, "arg": arg}))
        errors = []
        deadline = time.monotonic() + self.timeout
        for r in range(self.ranks):
            key = f"ack/{self.k}/{r}"
            while not self.store.check([key]):  # a vLLM rank that died says so under failed/{r}
                if self.store.check([f"failed/{r}"]):
                    raise reshard.Error(f"vLLM rank {r} failed: {self.store.get(f'failed/{r}').decode()[-2000:]}")
                if time.monotonic() > deadline:
                    raise reshard.Error(f"vLLM rank {r} did not answer '{method}' within {self.timeout} s")
                time.sleep(0.05)
            ans = json.loads(self.store.get(key).decode())
            if ans["error"]:
                errors.append(f"vLLM rank {r}: {ans['error']}")
        if errors:
            raise reshard.Error("; ".join(errors))
        return self.k

    def init_weight_transfer_engine(self, init_info):
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self.call("start_weight_update")

    def update_weights(self, update_info):
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self.call("finish_weight_update", weight_version)


def trainer(a, store):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import fsdp_cpu
    import reshard.vllm as rv  # registers the backend

    cfg = json.loads(pathlib.Path(a.config).read_text())
    ckpt = reshard.megatron_layout(pathlib.Path(a.config), "tp=1")
    model = fsdp_cpu.build(cfg, oracle.full_tensors(ckpt, seed=1))
    world = torch.distributed.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    client = CommandClient(store, a.vllm_tp)
    t0 = time.monotonic()
    eng = WeightTransferTrainerFactory.trainer_init(
        rv.ReshardTrainerInitInfo(rank=a.rank, world_size=world, store_port=a.backend_port),
        client=client, source=ModuleSource(model))
    out = {"init_seconds": time.monotonic() - t0, "steps": [], "bytes_sent": []}
    gen = torch.Generator().manual_seed(a.rank)
    for step in range(1, a.steps + 1):
        ids = torch.randint(0, cfg["vocab_size"], (2, 16), generator=gen)
        loss = model(input_ids=ids).logits.float().pow(2).mean()  # a toy objective: real optimizer steps
        loss.backward()
        opt.step()
        opt.zero_grad()
        full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective: every rank
        if a.rank == 0:
            torch.save(full, pathlib.Path(a.work) / f"v{step}.pt")
        if step == a.kill_at and a.rank == 1:
            os._exit(7)
        t0 = time.monotonic()
        try:
            eng.send_weights()
        except reshard.Error as e:
            out["failed_step"] = step
            out["error"] = str(e)
            if a.rank == 0:  # the engines must refuse to publish the failed version
                try:
                    client.finish_weight_update(str(step))
                    out["published_after_failure"] = True
                except reshard.Error as e2:
                    out["finish_error"] = str(e2)
                client.call("report")
            break
        out["steps"].append(time.monotonic() - t0)
        out["bytes_sent"].append(eng.last_report["bytes_sent"])
        if a.rank == 0:
            client.call("check", step)  # every vLLM rank against vLLM's own loader
    if "failed_step" not in out:
        # close() is collective: the engines' shutdown runs while every trainer rank closes its end.
        t = threading.Thread(target=client.call, args=("shutdown",)) if a.rank == 0 else None
        if t:
            t.start()
        eng.shutdown()
        if t:
            t.join()
    return out


def vllm_rank(a, store):
    import vllm_cpu

    work = pathlib.Path(a.work)
    os.environ.update(vllm_cpu.cpu_env(work))  # before vLLM picks its platform
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import reshard.vllm  # noqa: F401  registers the backend

    cfg = json.loads(pathlib.Path(a.config).read_text())
    model, vcfg = vllm_cpu.build(vllm_cpu.model_dir(cfg, work.parent / "model-dir"), a.vllm_tp)
    vllm_cpu.load(model, oracle.full_tensors(reshard.megatron_layout(pathlib.Path(a.config), "tp=1"), seed=0).items())
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="reshard"), vcfg,
                                                       torch.device("cpu"), model)
    me = int(os.environ["RANK"])
    out = {"checked": [], "engine": type(engine).__name__}
    k = 0
    while True:
        k += 1
        cmd = json.loads(store.get(f"cmd/{k}").decode())
        m, arg, err = cmd["method"], cmd["arg"], None
        try:
            if m == "init_weight_transfer_engine":
                engine.init_transfer_engine(engine.parse_init_info(arg))
            elif m == "start_weight_update":
                engine.start_weight_update()
            elif m == "update_weights":
                engine.update_weights(arg)
            elif m == "finish_weight_update":
                engine.finish_weight_update()
            elif m == "check":
                out["checked"].append(check(model, pathlib.Path(a.trainer_work) / f"v{arg}.pt", arg, engine))
            elif m == "report":
                out.update(version=engine.version, failed=engine.failed)
            elif m == "shutdown":
                engine.shutdown()
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        store.set(f"ack/{k}/{me}", json.dumps({"error": err}))
        if m in ("shutdown", "report"):
            out["version"] = engine.version
            return out


def check(model, path, version, engine):
    import vllm_cpu

    assert engine.version == version, f"published version {engine.version}, expected {version}"
    params = dict(model.named_parameters())
    got = {n: p.detach().clone() for n, p in params.items()}
    vllm_cpu.load(model, torch.load(path).items())  # vLLM's own loader of the trainer's full state dict
    bad = [n for n, p in params.items() if not torch.equal(got[n].view(torch.int16), p.detach().view(torch.int16))]
    if bad:
        raise AssertionError(f"version {version}: {len(bad)} parameters differ from vLLM's loader: {bad[:4]}")
    return {"version": version, "parameters": len(params), "received": engine.last_report["bytes_received"],
            "held": engine.live.real_bytes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["trainer", "vllm"])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--vllm-tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--store-port", type=int, required=True, help="the test's command store")
    ap.add_argument("--backend-port", type=int, required=True, help="the store trainer rank 0 hosts for reshard")
    ap.add_argument("--work", required=True)
    ap.add_argument("--trainer-work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {"role": a.role, "rank": a.rank}
    try:
        store = torch.distributed.TCPStore("127.0.0.1", a.store_port, None, False,
                                           timeout=datetime.timedelta(seconds=240))
        out.update(trainer(a, store) if a.role == "trainer" else vllm_rank(a, store))
        out["ok"] = True
    except BaseException:
        out.update(ok=False, error=traceback.format_exc())
        if a.role == "vllm":
            try:
                store.set(f"failed/{int(os.environ.get('RANK', a.rank))}", out["error"])
            except Exception:
                pass
    pathlib.Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
