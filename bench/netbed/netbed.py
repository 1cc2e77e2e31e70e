#!/usr/bin/env python3
"""netbed: a small cluster on one machine, for refits measured where the network is the bottleneck.

N hosts, each a network namespace with one interface `eth0` and an address,
joined by veth links to one bridge that lives in a switch namespace of its own.
Every link is rate-limited in both directions by an `htb` qdisc: on the host's
`eth0` (its egress) and on the bridge port that faces it (its ingress), so
each host has a full-duplex "NIC" of the given rate. With `--ranks-per-node K`
hosts are grouped into nodes of K; traffic between hosts of one node is
classed (u32 on the node's /24) to a second, faster htb class (`--intra-rate`,
a stand-in for NVLink), everything else goes at `--rate`.

Everything it creates lives in namespaces named `<prefix>h<i>` and
`<prefix>sw`; nothing is created in the root namespace (the veth pairs are
created with one end in a host namespace and the other in the switch
namespace). Deleting those namespaces (after killing what runs in them)
removes every link, bridge and qdisc with them. Teardown runs:

* after the command ends (success or failure), on SIGINT / SIGTERM / SIGHUP,
  after `--timeout` (the command is killed: SIGTERM, then SIGKILL after
  `--grace` seconds), and after a failure during setup;
* if netbed itself is killed with SIGKILL (no handler runs), a guardian
  process it started in its own session sees its pipe close and sweeps the
  prefix;
* if the guardian was killed too: `netbed.py cleanup --prefix P`.

Usage:
    netbed.py run --hosts 6 --rate 1gbit [--ranks-per-node 3 --intra-rate 10gbit] [--timeout 600] --each -- CMD ...
    netbed.py run ... --mpirun [--mpirun-arg ARG ...] -- CMD ...   (mpirun MPMD: rank i in host i)
    netbed.py run ... -- LAUNCHER ...   (in the root namespace, with NETBED_* in its environment)
    netbed.py cleanup --prefix rsnb-1234-
    netbed.py list

In commands run with --each or --mpirun, `{rank}`, `{world}`, `{addr}` and
`{master}` in the arguments are replaced by the host's index, the number of
hosts, the host's address and host 0's address; the environment holds
NETBED_RANK, NETBED_WORLD, NETBED_ADDR, NETBED_MASTER, NETBED_DEV (eth0)
and NETBED_PREFIX. A launcher (neither flag) gets NETBED_NAMESPACES and
NETBED_ADDRS (space-separated, host order) and runs hosts with
`ip netns exec NAME ...`.

Needs root, iproute2 (`ip`, `tc`) and the kernel's veth, bridge and htb.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

PREFIX_RE = re.compile(r"^rsnb-[a-z0-9]{1,12}-$")
RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$")
SUBNET = "10.213"
IP_TIMEOUT = 15  # seconds for any one `ip` / `tc` call


class NetbedError(Exception):
    """Bad input or a failed setup step; the message names what is wrong."""


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


def parse_rate(text: str, what: str) -> int:
    """A tc rate such as 1gbit / 500mbit / 2.5gbit -> bits per second."""
    m = RATE_RE.match(text or "")
    if not m:
        raise NetbedError(f"{what}: '{text}' is not a rate like 1gbit, 500mbit or 100kbit")
    bps = float(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    if bps < 1e5:
        raise NetbedError(f"{what}: {text} is below 100kbit (too slow to be useful)")
    if bps > 100e9:
        raise NetbedError(f"{what}: {text} is above 100gbit (veth cannot be shaped that fast here)")
    return int(bps)


def check_prefix(prefix: str) -> str:
    if not PREFIX_RE.match(prefix or ""):
        raise NetbedError(f"prefix '{prefix}' must look like rsnb-<1-12 of a-z0-9>- (e.g. rsnb-{os.getpid()}-), "
                          "so that a sweep removes only netbed's own namespaces")
    return prefix


def run_ip(args: list[str], what: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=IP_TIMEOUT)
    except FileNotFoundError:
        raise NetbedError(f"{what}: '{args[0]}' not found (install iproute2: bash scripts/setup.sh)")
    except subprocess.TimeoutExpired:
        raise NetbedError(f"{what}: `{' '.join(args)}` took more than {IP_TIMEOUT} s")
    if check and p.returncode != 0:
        raise NetbedError(f"{what}: `{' '.join(args)}` failed: {p.stderr.strip()}")
    return p


def list_namespaces(prefix: str = "rsnb-") -> list[str]:
    p = run_ip(["ip", "netns", "list"], "listing namespaces")
    names = [line.split()[0] for line in p.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def kill_namespace_processes(ns: str, deadline: float) -> None:
    """SIGKILL every process in namespace `ns` until none is left (or the deadline)."""
    while time.time() < deadline:
        p = run_ip(["ip", "netns", "pids", ns], f"listing processes in {ns}", check=False)
        pids = [int(x) for x in p.stdout.split()] if p.returncode == 0 else []
        pids = [x for x in pids if x != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def sweep(prefix: str, names: list[str] | None = None, budget_s: float = 30.0) -> list[str]:
    """Kills what runs in the prefix's namespaces and deletes them; returns what could not be deleted."""
    check_prefix(prefix)
    deadline = time.time() + budget_s
    present = set(list_namespaces(prefix))
    todo = [n for n in (names if names is not None else sorted(present)) if n in present and n.startswith(prefix)]
    for ns in todo:
        kill_namespace_processes(ns, deadline)
    left = []
    for ns in todo:
        p = run_ip(["ip", "netns", "del", ns], f"deleting {ns}", check=False)
        if p.returncode != 0 and ns in list_namespaces(prefix):
            left.append(ns)
    return left


class Bed:
    """The namespaces, links and qdiscs of one netbed; `create()` then `destroy()`."""

    def __init__(self, prefix: str, hosts: int, rate_bps: int, ranks_per_node: int = 0, intra_bps: int = 0,
                 log=None):
        self.prefix = check_prefix(prefix)
        if not 1 <= hosts <= 250:
            raise NetbedError(f"--hosts {hosts}: between 1 and 250 hosts")
        if ranks_per_node < 0 or (ranks_per_node and hosts % ranks_per_node):
            raise NetbedError(f"--ranks-per-node {ranks_per_node} does not divide --hosts {hosts} into whole nodes")
        if ranks_per_node and not intra_bps:
            raise NetbedError("--ranks-per-node needs --intra-rate (the rate between ranks of one node)")
        if intra_bps and not ranks_per_node:
            raise NetbedError("--intra-rate needs --ranks-per-node (which hosts share a node)")
        self.hosts, self.rate, self.rpn, self.intra = hosts, rate_bps, ranks_per_node, intra_bps
        self.switch = f"{prefix}sw"
        self.names = [f"{prefix}h{i}" for i in range(hosts)]
        self.log = log or (lambda msg: None)
        self.created: list[str] = []  # namespaces to delete, recorded before they exist

    def node_of(self, i: int) -> int:
        return i // self.rpn if self.rpn else i // 250

    def addr(self, i: int) -> str:
        k = i % self.rpn if self.rpn else i % 250
        return f"{SUBNET}.{self.node_of(i)}.{k + 1}"

    def _shape(self, ns: str, dev: str, match: str, node: int) -> None:
        """htb on `dev`'s egress: class 1:20 at the link rate; with nodes, 1:10 at the intra rate for the node's /24."""
        tc = ["tc", "-n", ns]
        run_ip(tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"], f"qdisc on {ns}/{dev}")
        for cls, bps in (("1:20", self.rate),) + ((("1:10", self.intra),) if self.rpn else ()):
            # burst: 2 ms at the rate, at least 64 KiB (a GSO segment on veth).
            burst = max(65536, int(bps / 8 * 0.002))
            quantum = 200000 if bps >= 1e9 else 60000
            run_ip(tc + ["class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate", f"{bps}bit", "ceil",
                         f"{bps}bit", "burst", str(burst), "cburst", str(burst), "quantum", str(quantum)],
                   f"htb class {cls} on {ns}/{dev}")
        if self.rpn:
            run_ip(tc + ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
                         match, f"{SUBNET}.{node}.0/24", "flowid", "1:10"], f"intra-node filter on {ns}/{dev}")

    def create(self, pause_after=None) -> None:
        self.created.append(self.switch)
        run_ip(["ip", "netns", "add", self.switch], "creating the switch namespace")
        run_ip(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"], "creating the bridge")
        run_ip(["ip", "-n", self.switch, "link", "set", "br0", "up"], "bringing up the bridge")
        for i, ns in enumerate(self.names):
            self.created.append(ns)
            run_ip(["ip", "netns", "add", ns], f"creating host {i}")
            run_ip(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch],
                   f"linking host {i}")
            run_ip(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/16", "dev", "eth0"], f"addressing host {i}")
            for dev in ("lo", "eth0"):
                run_ip(["ip", "-n", ns, "link", "set", dev, "up"], f"bringing up {dev} of host {i}")
            run_ip(["ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up"], f"attaching host {i}")
            self._shape(ns, "eth0", "dst", self.node_of(i))
            self._shape(self.switch, f"p{i}", "src", self.node_of(i))
            self.log(f"netbed: host {i} up: {ns} {self.addr(i)}")
            if pause_after is not None and pause_after == i:
                time.sleep(30)  # test hook (NETBED_TEST_PAUSE_AFTER_HOST): a signal lands mid-setup

    def destroy(self) -> list[str]:
        return sweep(self.prefix, list(self.created))

    def describe(self) -> dict:
        return {"prefix": self.prefix, "hosts": self.hosts, "namespaces": self.names, "switch": self.switch,
                "addrs": [self.addr(i) for i in range(self.hosts)], "rate_bps": self.rate,
                "ranks_per_node": self.rpn, "intra_rate_bps": self.intra}


def substitute(argv: list[str], env: dict[str, str]) -> list[str]:
    keys = {"rank": env["NETBED_RANK"], "world": env["NETBED_WORLD"], "addr": env["NETBED_ADDR"],
            "master": env["NETBED_MASTER"]}
    return [re.sub(r"\{(rank|world|addr|master)\}", lambda m: keys[m.group(1)], a) for a in argv]


def split_exports(args: list[str]) -> tuple[list[str], list[str]]:
    """--mpirun-arg's `-x VAR[=VALUE]` pairs apart from the other arguments: in an MPMD command line mpirun
    applies -x to the one app context it stands in (the first), so netbed repeats them in every host's."""
    shared, exports = [], []
    i = 0
    while i < len(args):
        if args[i] == "-x":
            if i + 1 == len(args):
                raise NetbedError("--mpirun-arg=-x is the last mpirun argument: it needs VAR or VAR=VALUE after it")
            exports += args[i:i + 2]
            i += 2
        else:
            shared.append(args[i])
            i += 1
    return shared, exports


def host_env(bed: Bed, i: int) -> dict[str, str]:
    return {"NETBED_RANK": str(i), "NETBED_WORLD": str(bed.hosts), "NETBED_ADDR": bed.addr(i),
            "NETBED_MASTER": bed.addr(0), "NETBED_DEV": "eth0", "NETBED_PREFIX": bed.prefix}


def start_guardian(prefix: str, names: list[str]) -> tuple[subprocess.Popen, int]:
    """A process in its own session that sweeps `names` once our end of a pipe closes (even after SIGKILL)."""
    r, w = os.pipe()
    g = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_guard", "--prefix", prefix, "--fd", str(r),
                          "--names", ",".join(names)], pass_fds=(r,), start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    os.close(r)
    return g, w


def guard_main(a) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while os.read(a.fd, 64):  # blocks until netbed's end closes (its exit, however it died)
        pass
    left = sweep(a.prefix, a.names.split(","))
    if left:
        print(f"netbed guardian: could not delete {' '.join(left)}", file=sys.stderr)
    return 0


def run_main(a) -> int:
    log = (lambda msg: None) if a.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if os.geteuid() != 0:
        raise NetbedError("needs root (network namespaces, veth, tc)")
    if not a.command:
        raise NetbedError("no command: netbed.py run [options] -- COMMAND ...")
    if a.each and a.mpirun:
        raise NetbedError("--each and --mpirun exclude each other")
    if a.timeout <= 0:
        raise NetbedError(f"--timeout {a.timeout}: must be > 0 seconds")
    shared, exports = split_exports(a.mpirun_arg)
    prefix = a.prefix or f"rsnb-{os.getpid()}-"
    bed = Bed(prefix, a.hosts, parse_rate(a.rate, "--rate"), a.ranks_per_node,
              parse_rate(a.intra_rate, "--intra-rate") if a.intra_rate else 0, log)
    if list_namespaces(prefix):
        raise NetbedError(f"namespaces with prefix {prefix} exist already ({' '.join(list_namespaces(prefix))}); "
                          f"run `netbed.py cleanup --prefix {prefix}` or pick another --prefix")
    pause = os.environ.get("NETBED_TEST_PAUSE_AFTER_HOST")
    pause = int(pause) if pause else None

    def on_signal(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    guardian, guard_w = start_guardian(prefix, [bed.switch] + bed.names)
    procs: list[subprocess.Popen] = []
    rc = 0
    t0 = time.time()
    try:
        bed.create(pause)
        log(f"netbed: {a.hosts} hosts up in {time.time() - t0:.1f} s, {a.rate} per host"
            + (f", {a.ranks_per_node} per node at {a.intra_rate}" if a.ranks_per_node else ""))
        if a.describe:
            with open(a.describe, "w") as f:
                json.dump(bed.describe(), f)
        base = dict(os.environ, NETBED_PREFIX=prefix, NETBED_NAMESPACES=" ".join(bed.names),
                    NETBED_ADDRS=" ".join(bed.addr(i) for i in range(a.hosts)), NETBED_DEV="eth0",
                    NETBED_MASTER=bed.addr(0), NETBED_WORLD=str(a.hosts))
        if a.each:
            for i, ns in enumerate(bed.names):
                env = dict(base, **host_env(bed, i))
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns] + substitute(a.command, env), env=env,
                                              start_new_session=True))
        elif a.mpirun:
            # mpirun runs in the switch namespace, with an address on the bridge, so that the ranks'
            # PMIx clients (TCP, no Unix sockets in PMIx 4) reach its server from their hosts.
            run_ip(["ip", "-n", bed.switch, "addr", "add", f"{SUBNET}.255.254/16", "dev", "br0"], "addressing the bridge")
            base.update(PMIX_MCA_ptl_tcp_remote_connections="1", PMIX_MCA_ptl_tcp_if_include="br0",
                        OMPI_MCA_oob_tcp_if_include="br0")
            cmd = ["ip", "netns", "exec", bed.switch, "mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"] + shared
            for i, ns in enumerate(bed.names):
                env = host_env(bed, i)
                cmd += ([":"] if i else []) + ["-np", "1"] + exports + sum((["-x", f"{k}={v}"] for k, v in env.items()), []) + \
                       ["ip", "netns", "exec", ns] + substitute(a.command, dict(base, **env))
            procs.append(subprocess.Popen(cmd, env=base, start_new_session=True))
        else:
            procs.append(subprocess.Popen(a.command, env=base, start_new_session=True))
        deadline = t0 + a.timeout
        while [p.poll() for p in procs].count(None):
            if time.time() > deadline:
                log(f"netbed: timeout after {a.timeout} s; stopping the command")
                rc = 124
                break
            if a.each and any(p.returncode not in (None, 0) for p in procs):
                log("netbed: a host's command failed; stopping the others")
                break
            time.sleep(0.05)
        if rc == 0:
            codes = [p.returncode for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            rc = (128 - bad[0] if bad[0] < 0 else bad[0]) if bad else 0
    except Interrupted as e:
        log(f"netbed: {e}; tearing down")
        rc = 128 + e.signum
    except NetbedError as e:
        print(f"netbed: {e}", file=sys.stderr)
        rc = 3
    finally:
        # Teardown cannot itself be interrupted by these signals (a second Ctrl-C would leave namespaces behind).
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        stop(procs, a.grace)
        left = bed.destroy()
        os.close(guard_w)  # the guardian sweeps again (nothing left) and exits
        try:
            guardian.wait(timeout=IP_TIMEOUT * 2)
        except subprocess.TimeoutExpired:
            pass
        if left:
            print(f"netbed: could not delete {' '.join(left)}", file=sys.stderr)
            rc = rc or 3
        log(f"netbed: torn down ({prefix}*), exit {rc}")
        for s, h in old.items():
            signal.signal(s, h)
    return rc


def stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to each command's process group, SIGKILL after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.time() + wait
        while time.time() < end and any(p.poll() is None for p in live):
            time.sleep(0.05)
        live = [p for p in live if p.poll() is None]
        if not live:
            return


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="netbed.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="create the hosts, run a command, tear down")
    r.add_argument("--hosts", type=int, required=True, help="number of hosts (namespaces), one rank each")
    r.add_argument("--rate", required=True, help="each host's link rate, both directions (tc syntax: 1gbit, 500mbit)")
    r.add_argument("--ranks-per-node", type=int, default=0, help="group hosts into nodes of this many (hosts 0..K-1 first)")
    r.add_argument("--intra-rate", help="with --ranks-per-node: rate between hosts of one node")
    r.add_argument("--timeout", type=float, default=600, help="seconds for setup and command (then killed); default 600")
    r.add_argument("--grace", type=float, default=3, help="seconds between SIGTERM and SIGKILL of the command")
    r.add_argument("--prefix", help="namespace prefix, rsnb-<a-z0-9>- (default rsnb-<pid>-)")
    r.add_argument("--each", action="store_true", help="run the command in every host")
    r.add_argument("--mpirun", action="store_true", help="run the command under mpirun, rank i in host i")
    r.add_argument("--mpirun-arg", action="append", default=[], help="extra argument to mpirun (repeatable)")
    r.add_argument("--describe", help="write the bed (namespaces, addresses, rates) as JSON to this file")
    r.add_argument("--quiet", action="store_true")
    r.add_argument("command", nargs=argparse.REMAINDER)
    c = sub.add_parser("cleanup", help="delete every namespace with this prefix (after a SIGKILL of netbed)")
    c.add_argument("--prefix", required=True)
    sub.add_parser("list", help="list netbed namespaces (prefix rsnb-)")
    g = sub.add_parser("_guard")
    g.add_argument("--prefix", required=True)
    g.add_argument("--fd", type=int, required=True)
    g.add_argument("--names", required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "run":
            if a.command and a.command[0] == "--":
                a.command = a.command[1:]
            return run_main(a)
        if a.cmd == "cleanup":
            left = sweep(a.prefix)
            if left:
                print(f"netbed: could not delete {' '.join(left)}", file=sys.stderr)
                return 1
            return 0
        if a.cmd == "list":
            print("\n".join(list_namespaces()))
            return 0
        return guard_main(a)
    except NetbedError as e:
        print(f"netbed: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
