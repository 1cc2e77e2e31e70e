"""An RL loop on Ray, on a CPU: FSDP2 trainer actors refit live vLLM rollout actors through vLLM's own
weight-transfer API with the "reshard" backend, step after step, checked against vLLM's own loader.

    python examples/python/vllm_rl_loop.py --model examples/models/tiny-llama.json --steps 3 --json

Trainer actors (``--trainers`` ranks, one gloo group) hold an FSDP2 HuggingFace model, or with
``--trainer megatron --train SPEC`` a Megatron-Core GPTModel under that spec (as many actors as it has
ranks; rl_megatron.py), and take real optimizer steps on a toy objective. Rollout actors
(``--rollout-tp`` ranks, ``--expert-parallel`` for an MoE) each hold one rank of a live vLLM engine,
built on the CPU by vLLM's own loader
(:mod:`reshard.engines.cpu`), with the engine ``WeightTransferEngineFactory`` makes for
``WeightTransferConfig(backend="reshard")``. Trainer rank 0 drives the engines' four phases through a
client that calls the rollout actors over Ray (vLLM's weight-sync client protocol); every trainer rank
calls ``send_weights()`` of the engine ``WeightTransferTrainerFactory.trainer_init`` makes. Everything
meets through Ray: ports are picked by the actors that listen on them.

Every step: an optimizer step; an update through the backend (timed), into rollout parameters whose
checkpoint elements were first set to junk (so a write the refit misses shows, however little the value
changed; not with ``--delta`` after the first update, nor with faults planted or ``--transactional``); every
rollout parameter compared, bit for bit, with vLLM's own ``load_weights`` of the trainer's full state dict
into a twin model, and the bytes each rollout rank received with those that load writes there
(:class:`reshard.engines.cpu.LoadedTwin`); then (unless
``--no-peer``) the same version through the path vLLM's ``nccl`` backend takes, with gloo in place of
NCCL: trainer rank 0 broadcasts the full tensors to every rollout rank, which calls ``load_weights`` inside
vLLM's layerwise reload (timed the same way, same processes): packed as vLLM 0.33 ships it (its own
``pack_tensors`` / ``unpack_tensor``, 1 GB buckets, two in flight: ``peer_seconds``), then one tensor at a
time (``peer_unpacked_seconds``). ``--delta`` makes the backend's updates delta refits;
``--master-f32`` keeps the trainer's parameters in f32 (FSDP2's MixedPrecisionPolicy computing in bf16,
as veRL runs it), which the backend casts to vLLM's bf16 in flight.
``--kill rollout:K@S`` (or ``trainer:K@S``) kills that actor inside step S's update: the step must fail
on every other actor, naming it, and no engine may publish the version; each surviving engine's report
of what its parameters hold (written, partly written, untouched) is checked against them, parameter by
parameter, element by element. ``--stall rollout:K@S`` makes that actor miss step S's update for a while
(a transient fault). ``--recover`` then repairs and goes on: a dead rollout rank, a new engine (every
rollout actor anew) set up by ``repair(client)``; a dead trainer rank, a restarted trainer (every rank,
from the last published weights) whose ``trainer_init`` sets up the same engines; a stall, ``repair()``
into the same engines; each repair's update is dense and checked bit for bit. ``--skip-finish S``: the
client skips step S's ``finish_weight_update``, and step S+1 must be refused for it.
``--plant-missed-write S`` (a planted fault): in step S, vLLM rank 0 puts back what one row of
``embed_tokens`` held before the update, a row the step did not change; the check must fail naming it.
``--quantization fp8``: the rollout engines serve the model in block FP8 (DeepSeek-V3's
``quantization_config``); the backend quantizes in flight, the check and the peer use the FP8 checkpoint
that reshard.engines.fp8's reference quantizer makes of the trainer's state; ``--plant-fp8-faults S``
(planted faults) leaves one scale one ulp off and one tile quantized from the wrong rows on vLLM rank 0
after step S's update: the check must fail naming both. ``--transactional``:
the engines' updates land in a staging copy of their parameters, copied in when published, so a failed
update leaves the live parameters at the last published version.

This file is the driver (the steps, a failure's checks, the repairs, the summary); the actors are in
rl_actors.py beside it.

The last line with ``--json`` is the summary: ``validated``,
``steps``, ``seconds`` (median update time through the backend) and ``peer_seconds`` (median of the
broadcast + ``load_weights`` path), with bytes, per-step times and any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import ray
import ray.cloudpickle
import rl_actors
import rl_megatron
from rl_actors import Rollout, Trainer, free_port
from rl_megatron import MegatronTrainer

from reshard.engines.fp8 import DEEPSEEK_V3_FP8

# The actors' modules are this script's siblings, not importable in Ray's workers: sent with their classes.
ray.cloudpickle.register_pickle_by_value(rl_actors)
ray.cloudpickle.register_pickle_by_value(rl_megatron)


def run(a) -> dict:
    cfg = json.loads(pathlib.Path(a.model).read_text())
    work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="vllm-rl-loop-", dir="/tmp"))  # vLLM binds sockets in it
    env = {"UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"), "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    os.environ.update(env)
    # Ray's own files in a short path of their own (its sockets' paths must fit 107 bytes), removed after.
    ray_dir = tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp")
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=a.verbose,
             runtime_env={"env_vars": env}, _temp_dir=ray_dir)
    out = {"model": str(a.model), "trainer": a.trainer, "train": a.train, "trainers": a.trainers,
           "rollout_tp": a.rollout_tp,
           "expert_parallel": a.expert_parallel, "delta": a.delta, "master_f32": a.master_f32,
           "optimizer": a.optimizer, "lr": a.lr, "quantization": a.quantization}
    try:
        return Loop(a, cfg, work, out).run()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


class Loop:
    """The driver: builds the actors, runs the steps, and after a failure checks what the engines say
    they hold and (``--recover``) repairs."""

    def __init__(self, a, cfg, work, out):
        self.a, self.cfg, self.work, self.out = a, cfg, work, out
        self.kill = {a.kill[:2]: a.kill[2]} if a.kill else {}
        self.stall = {a.stall[:2]: a.stall[2]} if a.stall else {}
        self.last_full = None  # the last published version's full state (a Ray ref), for a failure's check
        self.block = tuple(DEEPSEEK_V3_FP8["weight_block_size"]) if a.quantization == "fp8" else None

    def trainers_new(self, weights=None):
        a = self.a
        tport = free_port()
        if a.trainer == "megatron":
            actor = ray.remote(num_cpus=0)(MegatronTrainer)
            return [actor.remote(r, a.trainers, self.cfg, tport, a.seed, a.lr, a.optimizer, str(a.model), a.train)
                    for r in range(a.trainers)]
        actor = ray.remote(num_cpus=0)(Trainer)
        return [actor.remote(r, a.trainers, self.cfg, tport, a.seed, a.lr, a.optimizer,
                             0 if weights else self.kill.get(("trainer", r), 0), a.master_f32, weights)
                for r in range(a.trainers)]

    def rollouts_new(self, generation=0):
        a = self.a
        vport = free_port()
        actor = ray.remote(num_cpus=0, max_restarts=0)(Rollout)
        first = generation == 0
        cfg = json.loads(pathlib.Path(a.rollout_model).read_text()) if a.rollout_model else dict(self.cfg)
        if a.quantization == "fp8":
            cfg["quantization_config"] = DEEPSEEK_V3_FP8
        return [actor.remote(r, a.rollout_tp, cfg, vport, str(self.work), a.expert_parallel,
                             self.kill.get(("rollout", r), 0) if first else 0,
                             self.stall.get(("rollout", r), 0) if first else 0) for r in range(a.rollout_tp)]

    def init_transfer(self):
        """Every trainer rank's trainer_init: the longest one's seconds, or every rank's error."""
        store_port = ray.get(self.trainers[0].listen_port.remote())  # trainer rank 0 hosts the backend's store
        res = ray.get([t.init_transfer.remote(store_port, self.rollouts, self.a.delta, self.a.transactional)
                       for t in self.trainers])
        if any("error" in r for r in res):
            return {f"trainer {i}": r for i, r in enumerate(res)}
        return max(r["seconds"] for r in res)

    def run(self) -> dict:
        a, out = self.a, self.out
        t0 = time.monotonic()
        self.trainers, self.rollouts = self.trainers_new(), self.rollouts_new()
        ray.get([r.ready.remote() for r in self.rollouts + self.trainers])  # every model built
        self.references(self.rollouts)
        out["build_seconds"] = time.monotonic() - t0
        init = self.init_transfer()
        if isinstance(init, dict):
            out.update(validated=False, setup_failure=init, steps=0)
            return out
        out["init_seconds"] = init
        out["trace_seconds"] = ray.get([r.trace_seconds.remote() for r in self.rollouts])
        if a.peer:
            peer_port = ray.get(self.trainers[0].listen_port.remote())
            ray.get([t.peer_init.remote(peer_port, self.rollouts) for t in self.trainers])
        self.validated, self.times, self.peer_times, self.sent, self.peer_bytes, self.losses = True, [], [], [], [], []
        self.peer_unpacked_times = []
        for step in range(1, a.steps + 1):
            self.losses.append(ray.get([t.train_step.remote() for t in self.trainers])[0])
            t_step = time.monotonic()
            if step == a.skip_finish:
                ray.get(self.trainers[0].skip_next_finish.remote())
            if step == a.plant_fp8_faults:
                ray.get(self.rollouts[0].plant_fp8_faults.remote(step))
            if step == a.plant_missed_write:
                ray.get(self.rollouts[0].plant_missed_write.remote(step, self.unchanged_row()))
            res = [outcome(ref) for ref in [t.send.remote() for t in self.trainers]]
            errors = {f"trainer {i}": r["error"] for i, r in enumerate(res) if "error" in r}
            if step == a.skip_finish and not errors:
                # finish_weight_update was skipped: the next update must be refused on every trainer rank
                # (naming it); the engines then publish on finish_weight_update, and the step goes on.
                again = [outcome(ref) for ref in [t.send.remote() for t in self.trainers]]
                out["refused"] = {f"trainer {i}": r.get("error", "accepted") for i, r in enumerate(again)}
                ray.get([r.finish_weight_update.remote() for r in self.rollouts])
            if errors:
                out["failure"] = self.failure(step, errors, time.monotonic() - t_step)
                self.validated = False
                if not a.recover:
                    break
                out["recovery"] = self.recover(out["failure"])
                if not out["recovery"].get("validated"):
                    break
                continue
            self.times.append(res[0]["seconds"])
            self.sent.append(sum(r["bytes"] for r in res))
            out.setdefault("modes", []).append(res[0]["mode"])
            out["rank_bytes"] = res[0]["rank_bytes"]
            checks = self.check(res[0]["version"])
            out.setdefault("received", []).append([c["received"] for c in checks])
            out["held"] = [c["held"] for c in checks]
            if a.peer:
                pres = ray.get([t.peer_send.remote(True, self.block) for t in self.trainers])[0]
                self.peer_times.append(pres["seconds"])
                self.peer_bytes.append(pres["bytes"])
                pres = ray.get([t.peer_send.remote(False, self.block) for t in self.trainers])[0]
                self.peer_unpacked_times.append(pres["seconds"])
        if "failure" not in out or out.get("recovery", {}).get("validated"):
            ray.get([t.close.remote() for t in self.trainers] + [r.close.remote() for r in self.rollouts])
        times, peer_times = self.times, self.peer_times
        out.update(validated=self.validated and len(times) == a.steps, steps=len(times), update_seconds=times,
                   peer_update_seconds=peer_times, bytes=self.sent, peer_bytes=self.peer_bytes, losses=self.losses,
                   seconds=statistics.median(times) if times else None,
                   peer_seconds=statistics.median(peer_times) if peer_times else None,
                   peer_unpacked_update_seconds=self.peer_unpacked_times,
                   peer_unpacked_seconds=statistics.median(self.peer_unpacked_times) if peer_times else None)
        if times and peer_times:
            out["speedup"] = out["peer_seconds"] / out["seconds"]
            out["bytes_ratio"] = statistics.median(self.peer_bytes) / statistics.median(self.sent)
        return out

    def references(self, rollouts):
        """Each rollout's twin model for the checks, and when its parameters are set to junk before an
        update: not where a planted fault's check reads what the memory held before (a failed update's
        report) or where the update writes a staging copy; with delta refits only before the first."""
        a = self.a
        junk = "never" if (a.kill or a.stall or a.transactional) else "first" if a.delta else "every"
        ref = self.full_state()
        ray.get([r.reference.remote(ref, junk) for r in rollouts])

    def unchanged_row(self) -> int:
        """A row of embed_tokens held by vLLM rank 0 that this step's training left as it was."""
        name = "model.embed_tokens.weight"
        before, now = ray.get(self.last_full[0])[name], ray.get(self.full_state()[0])[name]
        rows = (before == now).all(dim=1)[: before.shape[0] // self.a.rollout_tp].nonzero()
        if not len(rows):
            raise RuntimeError("--plant-missed-write: every embed_tokens row of vLLM rank 0 changed this step")
        return int(rows[0])

    def full_state(self):
        ref = next(f for f in ray.get([t.full_state.remote() for t in self.trainers]) if f is not None)
        # Owned by the driver when a trainer may die: a restarted trainer starts from it.
        return [ray.put(ray.get(ref[0]))] if self.a.recover else ref

    def check(self, version):
        """Every rollout parameter bit for bit against vLLM's loader of the trainer's full state."""
        self.last_full = self.full_state()
        return ray.get([r.check.remote(self.last_full, version) for r in self.rollouts])

    def failure(self, step, errors, seconds):
        """What every actor says after a failed step: the trainers' errors, each surviving engine's state,
        its report checked against its memory (while every trainer lives: their full state is the failed
        version), and its answer to a finish_weight_update of the failed version (which must not publish it)."""
        f = failure(step, errors, self.rollouts, seconds)
        alive = [i for i in range(len(self.rollouts)) if errors.get(f"rollout {i}") != "dead"]
        if self.last_full is not None and not any(v == "dead" for k, v in errors.items() if k.startswith("trainer")):
            new = self.full_state()
            f["held"] = {f"rollout {i}": ray.get(self.rollouts[i].failure_check.remote(new, self.last_full))
                         for i in alive if self.rollouts[i] is not None}
        return f

    def recover(self, failure) -> dict:
        """The repair for what failed, then every engine checked bit for bit against the trainer."""
        t0 = time.monotonic()
        errors = failure["errors"]
        if any(v == "dead" for k, v in errors.items() if k.startswith("rollout")):
            kind = "rollout died: a new engine, repair(client)"
            for r in self.rollouts:
                ray.kill(r)  # the engine's other ranks go with it: vLLM restarts an engine whole
            self.rollouts = self.rollouts_new(generation=1)
            ray.get([r.ready.remote() for r in self.rollouts])
            self.references(self.rollouts)
            res = ray.get([t.repair.remote(self.rollouts) for t in self.trainers])
        elif any(v == "dead" for k, v in errors.items() if k.startswith("trainer")):
            kind = "trainer died: a restarted trainer's trainer_init"
            for t in self.trainers:
                ray.kill(t)
            self.trainers = self.trainers_new(weights=[self.last_full[0]])
            ray.get([t.ready.remote() for t in self.trainers])
            self.init_transfer()
            res = ray.get([t.send.remote() for t in self.trainers])
        else:
            kind = "transient: repair() into the same engines"
            res = ray.get([t.repair.remote() for t in self.trainers])
        out = {"kind": kind, "seconds": time.monotonic() - t0, "results": res}
        if any("error" in r for r in res):
            return out
        out["mode"] = res[0]["mode"]
        self.check(res[0]["version"])
        out["validated"] = True
        return out


def outcome(ref) -> dict:
    """An actor call's result, or what became of the actor."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError:
        return {"error": "dead"}


def failure(step, errors, rollouts, seconds):
    """The trainers' errors, each surviving engine's state and its answer to a finish_weight_update of the
    failed version (which must not publish it)."""
    published, finish = {}, {}
    for i, r in enumerate(rollouts):
        st = outcome(r.state.remote())
        if st.get("error") == "dead":
            errors[f"rollout {i}"] = "dead"
            continue
        errors[f"rollout {i}"] = st["failed"] or "no failure reported"
        try:
            ray.get(r.finish_weight_update.remote())
            finish[f"rollout {i}"] = "published"
        except ray.exceptions.RayTaskError as e:
            finish[f"rollout {i}"] = str(e.cause if e.cause is not None else e)
        published[f"rollout {i}"] = outcome(r.state.remote()).get("version")
    return {"step": step, "seconds": seconds, "errors": errors, "finish": finish, "published": published}


def kill_spec(text: str):
    try:
        role, rest = text.split(":")
        rank, step = (int(x) for x in rest.split("@"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected ROLE:RANK@STEP, e.g. rollout:1@2") from None
    if role not in ("trainer", "rollout") or rank < 0 or step < 1:
        raise argparse.ArgumentTypeError(f"'{text}': ROLE is trainer or rollout, RANK >= 0, STEP >= 1")
    return role, rank, step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(pathlib.Path(__file__).resolve().parents[1] / "models" / "tiny-llama.json"),
                    help="a HuggingFace config.json (Llama, Qwen3, Qwen3-MoE ...)")
    ap.add_argument("--trainer", choices=["fsdp", "megatron"], default="fsdp",
                    help="FSDP2 HuggingFace model, or a Megatron-Core GPTModel laid out by --train")
    ap.add_argument("--train", default="tp=2", metavar="SPEC",
                    help="the Megatron trainer's parallelism, in reshard.megatron_layout's syntax (tp=2,pp=2; "
                    "tp=2,ep=2,etp=1): its world size is the number of trainer actors")
    ap.add_argument("--trainers", type=int, default=2, help="FSDP2 trainer ranks")
    ap.add_argument("--rollout-tp", type=int, default=2, help="vLLM tensor-parallel ranks (one rollout actor each)")
    ap.add_argument("--expert-parallel", action="store_true", help="vLLM's enable_expert_parallel (MoE)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delta", action="store_true", help="delta refits through the backend")
    ap.add_argument("--master-f32", action="store_true",
                    help="f32 trainer parameters computed in bf16 (FSDP2 MixedPrecisionPolicy): cast in flight")
    ap.add_argument("--quantization", choices=["fp8"],
                    help="the rollout engines serve the model in block FP8 (DeepSeek-V3's quantization_config), "
                    "quantized in flight from the trainer's BF16; checked against vLLM's load_weights of the FP8 "
                    "checkpoint the reference quantizer makes (the peer sends that checkpoint)")
    ap.add_argument("--no-peer", dest="peer", action="store_false", help="skip the broadcast + load_weights peer")
    ap.add_argument("--stall", type=kill_spec, metavar="rollout:RANK@STEP",
                    help="a rollout actor misses a step's update for a while (a transient fault), e.g. rollout:1@2")
    ap.add_argument("--recover", action="store_true", help="after a failed update, repair and go on")
    ap.add_argument("--transactional", action="store_true",
                    help="the engines' updates land in a staging copy, copied into the live parameters when published")
    ap.add_argument("--skip-finish", type=int, default=0, metavar="STEP",
                    help="the client skips that step's finish_weight_update (the next update must be refused)")
    ap.add_argument("--rollout-model", help="another config.json for the rollouts (a mismatch: setup must fail "
                    "everywhere at once, naming it)")
    ap.add_argument("--plant-missed-write", type=int, default=0, metavar="STEP",
                    help="a planted fault: in that step one unchanged embed_tokens row of vLLM rank 0 is not written")
    ap.add_argument("--plant-fp8-faults", type=int, default=0, metavar="STEP",
                    help="planted faults (with --quantization fp8): after that step's update, vLLM rank 0 holds one "
                    "scale entry one ulp off and one tile quantized from the wrong rows")
    ap.add_argument("--kill", type=kill_spec, metavar="ROLE:RANK@STEP",
                    help="kill an actor in a step's update, e.g. rollout:1@2 or trainer:1@2")
    ap.add_argument("--work", help="a folder for vLLM's files, with a short path: vLLM binds sockets in it "
                    "(default: a temporary one under /tmp, removed); Ray's go to a temporary folder of their own")
    ap.add_argument("--verbose", action="store_true", help="the actors' logs on stderr")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line, last")
    a = ap.parse_args(argv)
    if a.trainer == "megatron":
        from reshard.engines.megatron import world_size
        try:
            a.trainers = world_size(a.train)
        except Exception as e:
            ap.error(f"--train: {e}")
        for flag, given in (("--master-f32", a.master_f32), ("--kill trainer:", a.kill and a.kill[0] == "trainer")):
            if given:
                ap.error(f"{flag} is not supported with --trainer megatron (FSDP2 trainers only)")
    if a.plant_fp8_faults and a.quantization != "fp8":
        ap.error("--plant-fp8-faults needs --quantization fp8")
    if a.kill and a.kill[1] >= (a.trainers if a.kill[0] == "trainer" else a.rollout_tp):
        ap.error(f"--kill {a.kill[0]}:{a.kill[1]}: there are {a.trainers} trainer and {a.rollout_tp} rollout actors")
    try:
        out = run(a)
    except Exception:
        out = {"validated": False, "error": traceback.format_exc()}
    if a.json:
        print(json.dumps(out), flush=True)
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0 if out.get("validated") or ((a.kill or a.stall) and "failure" in out) or \
        (a.rollout_model and "setup_failure" in out) else 1


if __name__ == "__main__":
    sys.exit(main())
