"""One process: a live vLLM engine rank (tp=1, the CPU recipe) with the engine the "reshard" backend gives
it, and one trainer rank (a HuggingFace model of the same config, vLLM's ModuleSource) whose client calls
the engine's phases directly. Runs the engine-life cases test_vllm_lifecycle.py asks for and prints one
JSON line: what each case saw, every refit compared bit for bit with vLLM's own load_weights.

    python lifecycle_worker.py CONFIG.json WORK
"""
import json
import os
import pathlib
import socket
import sys
import threading

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether a server can bind this port again, as a restarted trainer's store does (SO_REUSEADDR: the
    closed connections' TIME_WAIT does not count, a listening socket does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            return True
        except OSError:
            return False


class Direct:
    """vLLM's VLLMWeightSyncClient over an engine in this process."""

    def __init__(self, engine):
        self.engine = engine

    def init_weight_transfer_engine(self, info):
        self.engine.init_transfer_engine(self.engine.parse_init_info(info))

    def start_weight_update(self):
        self.engine.start_weight_update()

    def update_weights(self, info):
        self.engine.update_weights(info)

    def finish_weight_update(self, version=None):
        self.engine.finish_weight_update()


class Case:
    def __init__(self, cfg, model, vcfg):
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        import reshard.vllm as rv
        from reshard.engines import cpu
        self.rv, self.cpu, self.model = rv, cpu, model
        self.engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="reshard"), vcfg,
                                                                torch.device("cpu"), model)
        self.hf = cpu.hf_model(cfg, seed=1)
        self.source = ModuleSource(self.hf)
        self.port = free_port()

    def trainer(self, **kw):
        # Both sides share this process (and its GIL): a setup under load may go 10 s without progress
        # (the fresh-clone test run of ad55192 failed the re-init case so); no case here times a stall.
        info = self.rv.ReshardTrainerInitInfo(rank=0, world_size=1, store_port=self.port, timeout=60,
                                              stall_timeout=30, **kw)
        self.t = self.rv.ReshardTrainerEngine.trainer_init(info, client=Direct(self.engine), source=self.source)
        return self.t

    def step(self, seed, only=None):
        """An optimizer step's worth of change: every parameter, or only the one named."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in self.hf.named_parameters():
                if only is None or n == only:
                    p.add_((torch.randn(p.shape, generator=g) * 0.01).to(p.dtype))

    def differing(self):
        return self.cpu.differing_parameters(self.model, [(n, p.detach()) for n, p in self.hf.named_parameters()])

    def close(self):
        t = threading.Thread(target=self.engine.shutdown)  # the Resharder's close is collective
        t.start()
        self.t.shutdown()
        t.join()


def error_of(fn):
    try:
        fn()
    except Exception as e:
        return str(e)
    return None


def stale_binding(case):
    """A vLLM parameter re-allocated between updates: refused by name, the trainer re-binds, the update
    lands in the new storage; the old storage is left as it was."""
    t = case.trainer()
    t.send_weights()
    name = "model.layers.1.mlp.gate_up_proj.weight"
    p = dict(case.model.named_parameters())[name]
    old = p.data
    before = old.clone()
    p.data = p.data.clone()
    refused = error_of(case.engine.start_weight_update)
    if refused is None:  # accepted (a backend that does not check): undo the probe, the trainer starts its own
        case.engine.started = False
    round_before = t.round
    case.step(2)
    rep = t.send_weights()
    out = {"refused": refused, "mode": rep["mode"], "version": rep["version"], "re_set_up": t.round > round_before,
           "differing": case.differing(), "old_untouched": torch.equal(old.view(torch.int16), before.view(torch.int16)),
           "new_storage_bound": case.engine.live.buffers[name].data_ptr() == p.data.data_ptr()}
    p.data = p.data.to(torch.float32)  # a layout that no longer holds: refused by name, no re-bind
    out["changed_layout"] = error_of(t.send_weights)
    p.data = p.data.to(torch.bfloat16)
    out["after_restore"] = t.send_weights()["version"]
    out["differing_after_restore"] = case.differing()
    case.close()
    return out


STEPPED = "model.layers.0.mlp.down_proj.weight"


def sleep(case):
    """vLLM's sleep(level) / wake_up through the engine's hooks, with delta updates: refused while asleep;
    after a level-1 wake the bindings are kept (no new setup, a delta update); after level 2 the weights
    are gone (zeroed here, as discarded memory reads), and the next update re-binds and is dense. Each step
    changes one tensor only, so the updates are true deltas (not dense streaks) and a delta after level 2
    would leave the discarded tensors zero."""
    t = case.trainer(delta=True)
    t.send_weights()
    case.step(3, only=STEPPED)
    t.send_weights()
    out = {}
    for level in (1, 2):
        resharder = case.engine.resharder
        case.engine.sleep(level)
        out[f"asleep{level}"] = error_of(t.send_weights)
        if level == 2:
            with torch.no_grad():
                for p in case.model.parameters():
                    p.zero_()
        case.engine.wake_up()
        case.step(10 + level, only=STEPPED)
        rep = t.send_weights()
        out[f"level{level}"] = {"mode": rep["mode"], "kept": case.engine.resharder is resharder,
                                "differing": case.differing()}
    case.close()
    return out


def reinit(case):
    """A second init_transfer_engine closes the first setup's Resharder; after the trainer's shutdown its
    store port is free."""
    t = case.trainer()
    t.send_weights()
    first = case.engine.resharder
    t.repair()
    out = {"old_closed": first._closed, "new_open": not case.engine.resharder._closed,
           "differing": case.differing()}
    case.close()
    out["port_free"] = port_free(case.port)
    return out


def version(case):
    """Another vLLM than the one targeted: both sides refuse at init naming both versions."""
    import vllm
    real = vllm.__version__
    vllm.__version__ = "0.34.1"
    try:
        trainer = error_of(case.trainer)
        from torch.distributed import TCPStore
        port = free_port()
        store = TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # noqa: F841  the engine's peer
        info = case.rv.ReshardInitInfo("127.0.0.1", port, 1, "{}", prefix="v", timeout=20)
        engine = error_of(lambda: case.engine.init_transfer_engine(info))
    finally:
        vllm.__version__ = real
    return {"trainer": trainer, "engine": engine}


def eplb(case):
    """EPLB's redundant experts: refused at init naming the option (every side: the engine publishes it)."""
    pc = case.engine.vllm_config.parallel_config
    pc.enable_eplb = True
    try:
        out = {"enable_eplb": error_of(case.trainer)}
    finally:
        pc.enable_eplb = False
    return out


CASES = {"stale_binding": stale_binding, "sleep": sleep, "reinit": reinit, "version": version, "eplb": eplb}


def main():
    cfg_path, work = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    names = sys.argv[3:] or list(CASES)
    from reshard.engines import cpu
    os.environ.update(cpu.vllm_env(work), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    cfg = json.loads(cfg_path.read_text())
    model, vcfg = cpu.vllm_model(cpu.vllm_model_dir(cfg, work / "model-dir"), 1)
    out = {}
    for name in names:
        try:
            out[name] = CASES[name](Case(cfg, model, vcfg))
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
