"""A netbed described as a reshard topology (include/reshard/plan/topology.hpp's JSON form), for
`reshard-plan --topology FILE --simulate` and `reshard-refit --hierarchical --topology FILE`.

Every host is a "GPU"; without nodes each is its own node, with `ranks_per_node` K hosts 0..K-1 are node 0
(one NVLink domain), and so on, as netbed groups them (placement "launch": GPU = rank). The rates are the
links' payload rates: htb counts whole frames, and a TCP segment at MTU 1500 carries 1448 bytes of payload
(timestamps on) in a 1514-byte frame. The host model (shared cores, per-message and staging-copy costs,
fabric cap) is the `loopback` preset's, fitted on this machine (bench/calibration/).
"""
import re

PAYLOAD = 1448 / 1514


def gbit(rate: str) -> float:
    m = re.match(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$", rate)
    if not m:
        raise ValueError(f"'{rate}' is not a rate like 1gbit or 500mbit")
    return float(m.group(1)) * {None: 1e-9, "k": 1e-6, "m": 1e-3, "g": 1.0}[m.group(2)]


def topology_json(rate: str, ranks_per_node: int = 0, intra_rate: str | None = None) -> dict:
    nic = gbit(rate) * PAYLOAD
    t = {"name": f"netbed-{rate}" + (f"-nodes{ranks_per_node}-{intra_rate}" if ranks_per_node else ""),
         "base": "loopback", "nic_gbps": nic, "nvlink_gbps": nic, "gpus_per_node": 1, "nvlink_domain": 1,
         "placement": "launch"}
    if ranks_per_node:
        t.update(gpus_per_node=ranks_per_node, nvlink_domain=ranks_per_node, nvlink_gbps=gbit(intra_rate) * PAYLOAD)
    return t
