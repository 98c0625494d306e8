"""Which transport NCCL picked, read from its own log, and whether it is the one the
node's hardware offers.

With `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET`, NCCL prints one line per connection it
sets up when a communicator is created, e.g.

    gpu-a:2104:2188 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
    gpu-a:2104:2188 [3] NCCL INFO Channel 01 : 3[3] -> 4[4] via SHM/direct/direct
    gpu-a:2104:2190 [7] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [send] via NET/IB/0/GDRDMA
    gpu-a:2104:2190 [0] NCCL INFO Channel 00/0 : 15[7] -> 0[0] [receive] via NET/Socket/0

(`[send]`/`[receive]` on network connections; older NCCLs print a bus id in the brackets
and `P2P/IPC` or `P2P/direct pointer`), and `NCCL INFO Using network IB` (or `Socket`, or
a plugin's name). P2P is NVLink or PCIe between GPUs of a node, SHM copies through host
memory, NET/IB is InfiniBand (or RoCE) verbs, NET/Socket is TCP.

`transport_warnings` flags the slow choices: SHM between GPUs that NVLink connects, and
TCP sockets where the node has InfiniBand devices (or within one node). The hardware is
read by `host_links` (`nvidia-smi topo -m`, /sys/class/infiniband).
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Dict, List, Mapping, Sequence

_CHANNEL = re.compile(r"NCCL INFO Channel \d+(?:/\d+)? : \d+\[[0-9a-fA-Fx]+\] -> "
                      r"\d+\[[0-9a-fA-Fx]+\](?: \[(?:send|receive)\])? via (?P<via>.+?)\s*$")
_NETWORK = re.compile(r"NCCL INFO Using network (?P<name>\S+)")
_NVLINK = re.compile(r"^NV\d+$")
IB_CLASS = "/sys/class/infiniband"


def transport_of(via: str) -> str:
    """The transport of one connection's `via ...` text: P2P/CUMEM/read -> P2P/CUMEM,
    SHM/direct/direct -> SHM, NET/IB/0/GDRDMA -> NET/IB, NET/Socket/1 -> NET/Socket."""
    if via.startswith("NET/"):
        # NET/<the network's name>/<device>...; a plugin's name may hold a space or a
        # slash ("AWS Libfabric"): cut at the device number.
        match = re.match(r"NET/(.+?)/\d", via)
        return "NET/" + (match.group(1) if match else via[4:])
    parts = via.split("/")
    if parts[0] == "P2P" and len(parts) > 1:
        return "P2P/" + parts[1]
    return parts[0]


def transports(log: str) -> Dict[str, int]:
    """{transport: connections} of every `Channel ... via ...` line of an NCCL log."""
    counts: Dict[str, int] = {}
    for line in log.splitlines():
        match = _CHANNEL.search(line)
        if match:
            kind = transport_of(match.group("via"))
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def network(log: str) -> str:
    """The network NCCL loaded ("IB", "Socket", a plugin's name), or "" when not logged."""
    match = _NETWORK.search(log)
    return match.group("name") if match else ""


def nvlink_in_topology(topo: str) -> bool:
    """Whether `nvidia-smi topo -m` shows an NVLink (NV1, NV12, NV18 ...) between GPUs."""
    for line in topo.splitlines():
        words = line.split()
        if words and words[0].startswith("GPU") and any(_NVLINK.match(w) for w in words[1:]):
            return True
    return False


def host_links(run=subprocess.run, ib_class: str = IB_CLASS) -> Dict[str, object]:
    """This GPU node's links: {"nvlink": NVLink between its GPUs, "ib": its InfiniBand
    (verbs) devices}. Only read on nodes with GPUs."""
    try:
        topo = run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                   timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        topo = ""
    try:
        ib = sorted(os.listdir(ib_class))
    except OSError:
        ib = []
    return {"nvlink": nvlink_in_topology(topo), "ib": ib}


def transport_warnings(found: Mapping[str, int], nvlink: bool, ib: Sequence[str],
                       nodes: int, environ: Mapping[str, str]) -> List[str]:
    """Warnings where NCCL's transports are slower than the node's hardware allows.

    Args:
      found: `transports` of this node's log.
      nvlink: NVLink connects this node's GPUs.
      ib: this node's InfiniBand devices.
      nodes: the job's nodes (a one-node job has no business on the network).
      environ: the node's environment (the NCCL switches named as the likely cause).
    """
    set_vars = lambda names: [f"{n}={environ[n]}" for n in names if environ.get(n)]
    warnings = []
    if found.get("SHM") and nvlink:
        why = set_vars(("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL")) or [
            "peer access is off: in a container, CUDA IPC needs the host's IPC namespace "
            "(docker --ipc=host)"]
        warnings.append(f"NCCL connects GPUs of this node through host memory (SHM, "
                        f"{found['SHM']} connections) though NVLink connects them: "
                        + "; ".join(why))
    sockets = found.get("NET/Socket", 0)
    if sockets and ib:
        why = set_vars(("NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_NET")) or [
            "NCCL found no usable verbs device: in a container, pass /dev/infiniband and "
            "install libibverbs (rdma-core)"]
        warnings.append(f"NCCL uses TCP sockets ({sockets} connections) though this node "
                        f"has InfiniBand devices ({', '.join(ib)}): " + "; ".join(why))
    elif sockets and nodes == 1:
        why = set_vars(("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")) or [
            "neither peer access nor shared memory works between its processes"]
        warnings.append(f"NCCL uses TCP sockets ({sockets} connections) between GPUs of "
                        "one node" + (" though NVLink connects them" if nvlink else "")
                        + ": " + "; ".join(why))
    return warnings
