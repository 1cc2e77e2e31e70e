#!/usr/bin/env python3
"""Refits on a netbed cluster (bench/netbed/netbed.py): each rank on its own network host, links rate-limited,
every refit validated element by element, and the simulator's prediction for the same topology beside each.

Cases (Megatron tp=2 -> vLLM tp=4 of the 938 MiB Llama-like model unless said; 6 hosts, one rank each):
  dense   reshard-refit --transport ucx under mpirun, one rank per host
  delta   reshard-refit --delta --versions V (Adam at lr 1e-6): the delta and the dense refit of the same versions
  fp8     reshard-refit --infer tp=4,quant=fp8 (quantized on the senders, FP8 on the wire)
  gloo    bench/python_refit.py --rank R in each host: reshard.Resharder (UCX) and the torch.distributed gloo
          bucketed broadcast of full tensors (as veRL / OpenRLHF refit), same processes, same links
  hier    nodes of 2 hosts (intra-node links --intra-factor x faster), a smaller Llama-like model
          (bench/netbed/llama-220m.json) from tp=2 to tp=1,dp=4 (every rollout rank needs the whole model):
          the direct plan and the staged (hierarchical) plan, each in its own netbed of the same shape

Predictions: `reshard-plan ... --topology T --simulate --stats` with T the netbed described as a topology
(bench/netbed/topology.py): every host its own node (or nodes of 2 for hier), `nic_gbps` the link rate times
1448/1514 (TCP payload of a 1514-byte frame at MTU 1500, which htb counts whole), on the `loopback` preset's
host model (2 shared cores: its fabric cap, per-message and staging-copy costs). Delta predictions take each
delta version at its own measured changed fraction (the median of them beside the median measured) and
the host's memory rate (--delta-device-gbps: by default fitted once per run on plain loopback, where the CPU
bounds the refit: the "delta: loopback fit" record; docs/delta.md, "Simulator"); the simulator overlaps diff,
transfer and scatter in slices as the executor runs them, charges the shared cores with every diff, scatter and the
payloads' moving, and charges the FP8 senders' quantizing at the preset's quantize_gbps (bench/quantize_bench.cpp).

    python3 bench/netbed/refits.py --rates 1gbit,5gbit [--cases dense,delta,fp8,gloo,hier] [--out runs.jsonl]
    python3 bench/netbed/refits.py --smoke      (CI: tiny models, 4 hosts, seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import netbed  # noqa: E402
from topology import topology_json  # noqa: E402

UCX_ENV = ["--mpirun-arg=-x", "--mpirun-arg=UCX_TLS=tcp,self", "--mpirun-arg=-x", "--mpirun-arg=UCX_NET_DEVICES=eth0"]


def sh(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return p.returncode, p.stdout, p.stderr


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON line in the output")


class Runner:
    def __init__(self, a):
        self.a = a
        self.build = os.path.abspath(a.build)
        self.refit = os.path.join(self.build, "bin", "reshard-refit")
        self.plan = os.path.join(self.build, "bin", "reshard-plan")
        for b in (self.refit, self.plan):
            if not os.access(b, os.X_OK):
                sys.exit(f"refits.py: {b} is not built (cmake --build {a.build} --target reshard-refit reshard-plan)")
        self.records = []
        self.fitted_gbps = None
        self.load_before = os.getloadavg()[0]
        self.topo_dir = a.work
        os.makedirs(self.topo_dir, exist_ok=True)

    def netbed(self, hosts, rate, mode, cmd, rpn=0, intra=None, timeout=900):
        nb = [sys.executable, os.path.join(HERE, "netbed.py"), "run", "--quiet", "--hosts", str(hosts), "--rate", rate,
              "--timeout", str(timeout)]
        if rpn:
            nb += ["--ranks-per-node", str(rpn), "--intra-rate", intra]
        nb += (["--mpirun"] + UCX_ENV if mode == "mpirun" else ["--each"]) + ["--"] + cmd
        t0 = time.time()
        self.load_before = os.getloadavg()[0]  # 1-minute load average: other work on the same 2 cores
        rc, out, err = sh(nb, timeout + 60)
        if rc != 0:
            raise RuntimeError(f"exit {rc}: {shlex.join(nb)}\n{err[-3000:]}")
        return nb, last_json(out), time.time() - t0

    def topology(self, rate, rpn=0, intra=None):
        t = topology_json(rate, rpn, intra)
        path = os.path.join(self.topo_dir, f"{t['name']}.json")
        with open(path, "w") as f:
            json.dump(t, f)
        return path

    def predict(self, model_args, topo, extra=()):
        cmd = [self.plan] + model_args + ["--topology", topo, "--simulate", "--stats"] + list(extra)
        rc, out, err = sh(cmd, 600)
        if rc != 0:
            raise RuntimeError(f"exit {rc}: {shlex.join(cmd)}\n{err}")
        return cmd, json.loads(out)["simulation"]

    def record(self, case, rate, measured, predicted, cmd, sim_cmd, **extra):
        r = {"case": case, "rate": rate, "measured_s": measured, "predicted_s": predicted,
             "load_before": self.load_before, "load_after": os.getloadavg()[0],
             "measured_over_predicted": measured / predicted if predicted else None,
             "command": shlex.join(cmd), "sim_command": shlex.join(sim_cmd) if sim_cmd else None, **extra}
        self.records.append(r)
        pred = f"{predicted:8.3f}" if predicted else "       -"
        ratio = f"{measured / predicted:6.2f}" if predicted else "     -"
        print(f"{case:<22} {rate:>8} {measured:9.3f} {pred} {ratio}  {extra.get('note', '')} "
              f"(load {r['load_before']:.1f}-{r['load_after']:.1f})", flush=True)
        if self.a.out:
            with open(self.a.out, "a") as f:
                f.write(json.dumps(r) + "\n")

    def model_args(self, infer=None):
        return ["--model", self.a.model, "--train", self.a.train, "--infer", infer or self.a.infer]

    def hosts(self, infer=None):
        return netbed_hosts(self.a.train, infer or self.a.infer)

    def dense(self, rate):
        cmd = [self.refit, "--transport", "ucx"] + self.model_args() + ["--no-baseline", "--iterations",
                                                                            str(self.a.iterations), "--json"]
        nb, j, _ = self.netbed(self.hosts(), rate, "mpirun", cmd)
        assert j["validated"], "dense refit not validated"
        sc, sim = self.predict(self.model_args(), self.topology(rate))
        self.record("dense", rate, j["seconds"], sim["predicted_seconds"], nb, sc, bytes=j["bytes_moved"],
                    iteration_seconds=j["iteration_seconds"], validated=j["validated"],
                    note=f"{j['bytes_moved'] / 2**20:.1f} MiB, busiest link {j['bottleneck_gb_per_s'] * 8:.2f} Gb/s")
        return j

    def delta_cmd(self):
        return [self.refit, "--transport", "ucx"] + self.model_args() + ["--delta", "--versions", str(self.a.versions),
                                                                         "--no-baseline", "--json"]

    def predict_versions(self, j, topo, gbps):
        """Each delta version of a reshard-refit --delta run predicted at its own changed fraction (the first
        after the prime changes the most); the median of those goes beside the median measured."""
        versions, sc = [], None
        for v in j["delta"]["per_version"]:
            if v["mode"] != "delta":
                continue
            sc, sim = self.predict(self.model_args(), topo, ["--delta-density", f"{v['changed_fraction']:.4f}",
                                                             "--delta-device-gbps", f"{gbps:g}"])
            versions.append({"changed_fraction": v["changed_fraction"], "measured_s": v["seconds"],
                             "predicted_s": sim["delta"]["seconds"], "bytes": v["bytes_moved"]})
        if not versions:
            raise RuntimeError("no version of the delta run was refit as a delta (every one went dense)")
        return versions, sc, sim

    def device_gbps(self):
        """--delta-device-gbps, or with `fit` the host's memory rate fitted once per run where the CPU alone bounds
        the delta refit: the same command on plain loopback (every rank on `lo`, no link limit), and the rate at
        which the loopback model predicts its median delta version (docs/delta.md, "Simulator")."""
        if self.a.delta_device_gbps != "fit":
            return float(self.a.delta_device_gbps)
        if self.fitted_gbps is not None:
            return self.fitted_gbps
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
        cmd = ["mpirun", "-np", str(self.hosts()), "--bind-to", "none", "-x", "UCX_TLS=tcp,self", "-x",
               "UCX_NET_DEVICES=lo"] + self.delta_cmd()
        self.load_before = os.getloadavg()[0]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"the loopback fit: exit {p.returncode}: {shlex.join(cmd)}\n{p.stderr[-3000:]}")
        j = last_json(p.stdout)
        assert j["validated"], "the loopback fit's delta refit not validated"
        measured = j["delta"]["seconds"]

        def predicted(gbps):
            return statistics.median(v["predicted_s"] for v in self.predict_versions(j, "loopback", gbps)[0])
        lo, hi = 0.5, 1000.0  # GB/s; the prediction falls as the rate grows, down to the transfer's floor
        if predicted(hi) > measured or predicted(lo) < measured:
            raise RuntimeError(f"the loopback fit: no memory rate in {lo:g}-{hi:g} GB/s predicts the measured "
                               f"{measured:.3f} s")
        while hi / lo > 1.01:
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if predicted(mid) > measured else (lo, mid)
        self.fitted_gbps = round((lo * hi) ** 0.5, 2)
        versions, sc, _ = self.predict_versions(j, "loopback", self.fitted_gbps)
        self.record("delta: loopback fit", "lo", measured, statistics.median(v["predicted_s"] for v in versions),
                    cmd, sc, delta_device_gbps=self.fitted_gbps, versions=versions, validated=j["validated"],
                    note=f"--delta-device-gbps fitted: {self.fitted_gbps:g} GB/s of memory traffic")
        return self.fitted_gbps

    def delta(self, rate):
        gbps = self.device_gbps()
        nb, j, _ = self.netbed(self.hosts(), rate, "mpirun", self.delta_cmd())
        assert j["validated"], "delta refit not validated"
        d, dn = j["delta"], j["dense"]
        versions, sc, sim = self.predict_versions(j, self.topology(rate), gbps)
        predicted = statistics.median(v["predicted_s"] for v in versions)
        ratio = d["seconds"] / dn["seconds"]
        self.record("delta", rate, d["seconds"], predicted, nb, sc, changed_fraction=d["changed_fraction"],
                    bytes=d["bytes_moved"], dense_seconds=dn["seconds"], dense_bytes=dn["bytes_moved"],
                    delta_over_dense=ratio, validated=j["validated"], versions=versions, delta_device_gbps=gbps,
                    note=f"{d['changed_fraction'] * 100:.2f}% changed, {d['bytes_moved'] / 2**20:.1f} MiB; "
                         f"delta/dense time {ratio:.3f}")
        self.record("delta: its dense refit", rate, dn["seconds"], sim["predicted_seconds"], nb, sc,
                    bytes=dn["bytes_moved"], note="the same versions refit dense, same run")

    def fp8(self, rate):
        infer = (self.a.fp8_infer or self.a.infer) + ",quant=fp8"
        cmd = [self.refit, "--transport", "ucx"] + self.model_args(infer) + ["--no-baseline", "--iterations",
                                                                             str(self.a.iterations), "--json"]
        nb, j, _ = self.netbed(self.hosts(infer), rate, "mpirun", cmd)
        assert j["validated"], "FP8 refit not validated"
        sc, sim = self.predict(self.model_args(infer), self.topology(rate))
        self.record("fp8", rate, j["seconds"], sim["predicted_seconds"], nb, sc, bytes=j["bytes_moved"],
                    validated=j["validated"], note=f"{j['bytes_moved'] / 2**20:.1f} MiB on the wire")

    def gloo(self, rate):
        tp_t, tp_i = spec_tp(self.a.train), spec_tp(self.a.infer)
        cmd = [self.a.python, os.path.join(ROOT, "bench", "python_refit.py"), "--rank", "{rank}", "--master",
               "{master}:29517", "--iterations", str(self.a.gloo_iterations), "--json", "--train-tp", str(tp_t),
               "--infer-tp", str(tp_i)] + self.a.python_model
        nb, j, _ = self.netbed(tp_t + tp_i, rate, "each", cmd)
        assert j["validated"], "gloo peer and reshard disagree"
        sc, sim = self.predict(["--model", self.python_model_file(), "--train", f"tp={tp_t}", "--infer", f"tp={tp_i}"],
                               self.topology(rate))
        sp = j["baseline"]["seconds"] / j["reshard"]["seconds"]
        self.record("gloo peer: reshard", rate, j["reshard"]["seconds"], sim["predicted_seconds"], nb, sc,
                    bytes=j["reshard"]["bytes_moved"], speedup=sp, note=f"{sp:.2f}x faster than gloo broadcast, same run")
        self.record("gloo peer: broadcast", rate, j["baseline"]["seconds"], None, nb, None,
                    iteration_seconds=j["baseline"]["iteration_seconds"], note=f"{self.a.bucket_note}")

    def python_model_file(self):
        """python_refit.py's model (with --python-model's flags) as a config file, for reshard-plan."""
        path = os.path.join(self.topo_dir, "python_refit_model.json")
        rc, out, err = sh([self.a.python, os.path.join(ROOT, "bench", "python_refit.py"), "--config-out", path]
                          + self.a.python_model, 300)
        if rc != 0:
            raise RuntimeError(f"python_refit.py --config-out: exit {rc}: {err}")
        return path

    def hier(self, rate):
        intra = scale_rate(rate, self.a.intra_factor)
        margs = ["--model", self.a.hier_model, "--train", self.a.hier_train, "--infer", self.a.hier_infer]
        hosts = netbed_hosts(self.a.hier_train, self.a.hier_infer)
        topo = self.topology(rate, 2, intra)
        base = [self.refit, "--transport", "ucx"] + margs + ["--no-baseline", "--iterations", str(self.a.iterations), "--json"]
        out = {}
        for name, extra, sim_extra in (("direct", [], []), ("staged", ["--hierarchical", "--topology", topo],
                                                             ["--hierarchical"])):
            nb, j, _ = self.netbed(hosts, rate, "mpirun", base + extra, rpn=2, intra=intra)
            assert j["validated"], f"{name} refit not validated"
            sc, sim = self.predict(margs, topo, sim_extra)
            out[name] = (j["seconds"], sim["predicted_seconds"])
            self.record(f"hier: {name}", rate, j["seconds"], sim["predicted_seconds"], nb, sc, intra_rate=intra,
                        ranks_per_node=2, bytes=j["bytes_moved"], note=f"nodes of 2 at {intra} inside")
        m = out["direct"][0] / out["staged"][0]
        p = out["direct"][1] / out["staged"][1]
        print(f"{'hier: direct/staged':<22} {rate:>8} measured {m:.2f}x, predicted {p:.2f}x, ratio {m / p:.2f}", flush=True)
        self.records[-1]["speedup_measured"], self.records[-1]["speedup_predicted"] = m, p


def spec_tp(spec: str) -> int:
    kv = dict(x.split("=") for x in spec.split(","))
    return int(kv.get("tp", 1))


def netbed_hosts(train: str, infer: str) -> int:
    def world(spec):
        kv = dict(x.split("=") for x in spec.split(",") if not x.startswith("quant"))
        n = 1
        for k in ("tp", "pp", "dp", "cp"):
            n *= int(kv.get(k, 1))
        return n
    return world(train) + world(infer)


def scale_rate(rate: str, factor: int) -> str:
    return f"{netbed.parse_rate(rate, '--rates') * factor // 1_000_000}mbit"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rates", default="1gbit,5gbit")
    ap.add_argument("--cases", default="dense,delta,fp8,gloo,hier")
    ap.add_argument("--model", default="examples/models/llama-1gb.json")
    ap.add_argument("--train", default="tp=2")
    ap.add_argument("--infer", default="tp=4")
    ap.add_argument("--fp8-infer", help="the fp8 case's inference spec (default --infer's)")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--gloo-iterations", type=int, default=2)
    ap.add_argument("--hier-model", default="bench/netbed/llama-220m.json")
    ap.add_argument("--hier-train", default="tp=2")
    ap.add_argument("--hier-infer", default="tp=1,dp=4")
    ap.add_argument("--intra-factor", type=int, default=10)
    ap.add_argument("--delta-device-gbps", default="fit",
                    help="the simulator's memory rate for the host diff and scatter (GB/s of bytes read + written), "
                         "or `fit` (default): fitted once per run on plain loopback, where the CPU bounds the delta "
                         "refit (docs/delta.md, \"Simulator\"; 8 on the 2-core machine of 2026-12-06, 10.5 on that "
                         "of 2026-12-07)")
    ap.add_argument("--python", help="a Python with torch and the reshard package (the gloo case; default: the "
                                      "package venv, as `scripts/venvs.sh --python package` prints it)")
    ap.add_argument("--python-model", nargs="*", default=[], help="python_refit.py model flags, e.g. --layers 2")
    ap.add_argument("--out", help="append one JSON record per case to this file")
    ap.add_argument("--work", default="/tmp/reshard-netbed", help="folder for the topology files")
    ap.add_argument("--smoke", action="store_true", help="CI: tiny models on 4-6 hosts at 1gbit, one iteration")
    a = ap.parse_args()
    if a.python is None:
        a.python = subprocess.run(["bash", os.path.join(ROOT, "scripts", "venvs.sh"), "--python", "package"],
                                  capture_output=True, text=True, check=True).stdout.strip()
    if a.delta_device_gbps != "fit":
        try:
            if float(a.delta_device_gbps) <= 0:
                raise ValueError
        except ValueError:
            sys.exit(f"refits.py: --delta-device-gbps {a.delta_device_gbps!r}: a positive number of GB/s, or fit")
    if a.smoke:
        a.rates, a.model, a.infer, a.iterations, a.versions = "1gbit", "examples/models/tiny-llama.json", "tp=2", 1, 3
        if a.delta_device_gbps == "fit":
            a.delta_device_gbps = "8"  # tiny-llama's refit is all per-message costs: nothing to fit the rate on
        a.hier_model, a.gloo_iterations = "examples/models/tiny-llama.json", 1
        a.fp8_infer = "tp=1,dp=2"  # tiny-llama's 64 kv rows: FP8 tiles of 128 rows must not be cut
        a.python_model = ["--layers", "1", "--hidden", "256", "--intermediate", "512", "--heads", "8", "--kv-heads", "2",
                          "--vocab", "1024"]
        if not os.access(a.python, os.X_OK):
            a.cases = ",".join(c for c in a.cases.split(",") if c != "gloo")
            print(f"refits.py: no {a.python}: the gloo case is skipped", flush=True)
    a.bucket_note = "256 MiB buckets, full tensors from trainer rank 0 to every rollout rank"
    r = Runner(a)
    unknown = set(a.cases.split(",")) - {"dense", "delta", "fp8", "gloo", "hier"}
    if unknown:
        sys.exit(f"refits.py: unknown case(s) {', '.join(sorted(unknown))} (dense, delta, fp8, gloo, hier)")
    print(f"{'case':<22} {'rate':>8} {'measured':>9} {'predicted':>8} {'ratio':>6}  (seconds, median refit)", flush=True)
    failed = 0
    for rate in a.rates.split(","):
        netbed.parse_rate(rate, "--rates")
        for case in a.cases.split(","):
            try:
                getattr(r, case)(rate)
            except Exception as e:  # noqa: BLE001 - report and go on with the other cases
                failed += 1
                print(f"{case} at {rate}: FAILED: {e}", file=sys.stderr, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
