"""The job's findings from every rank's doctor report (`tfllm.doctor.job`): what
differs between nodes, what client 0 cannot reach, XLA's files, the all-reduce's
bandwidth and NCCL's transports. Pure functions of the reports, so every rule is tested
with reports written by hand.
"""

from __future__ import annotations

import json
from typing import Dict, List, Mapping, Optional, Sequence

from tfllm.doctor import nccl_log, xla_files
from tfllm.runtime.gpu_checks import Finding

#: the NCCL variables that decide the transport, listed even when unset
NCCL_SETTINGS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE",
                 "NCCL_NVLS_ENABLE", "NCCL_IB_DISABLE", "NCCL_NET_GDR_LEVEL")
MIB = 1 << 20


def _node(r: Mapping) -> str:
    return f"{r['host']} (rank {r['rank']})"


def _groups(reports: Sequence[dict], key) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for r in reports:
        value = key(r)
        out.setdefault(value if isinstance(value, str) else json.dumps(value),
                       []).append(_node(r))
    return out


def _some(nodes: Sequence[str]) -> str:
    return ", ".join(nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")


def _gpu_list(gpus: Sequence[str]) -> str:
    """['H100', 'H100'] -> '2 x H100'."""
    counts: Dict[str, int] = {}
    for g in gpus:
        counts[g] = counts.get(g, 0) + 1
    return ", ".join(f"{n} x {g}" for g, n in sorted(counts.items())) or "none"


def _differ(what: str, groups: Dict[str, List[str]]) -> str:
    parts = [f"{value} on {', '.join(nodes[:3])}{' ...' if len(nodes) > 3 else ''}"
             for value, nodes in sorted(groups.items(), key=lambda g: -len(g[1]))]
    return f"{what} differ between nodes: " + "; ".join(parts)


def _has_gpu(r: Mapping) -> bool:
    return bool(r.get("gpus") or r.get("tf_gpus"))


def compare(reports: Dict[int, dict], size: int, waited_s: float,
            probed: Sequence[dict] = (), plan: Optional[dict] = None,
            results: Optional[Dict[int, dict]] = None, invalid=()) -> List[Finding]:
    """The job's findings (see `tfllm.doctor.job`).

    Args:
      reports: rank -> its report.
      size: the job's ranks.
      waited_s: how long rank 0 waited for the reports.
      probed: `doctor.reachability`'s records (client 0's connections).
      plan: `doctor.bandwidth_plan` (None: no bandwidth test was considered).
      results: rank -> its all-reduce result (`allreduce.run_client`).
      invalid: ranks whose report file is no report (the caller says so): not missing.
    """
    findings: List[Finding] = []
    missing = [r for r in range(size) if r not in reports and r not in invalid]
    if missing:
        findings.append(Finding("error", f"ranks {', '.join(map(str, missing))} of {size} "
                                         f"wrote no report within {waited_s:g} s: their "
                                         "nodes did not run the doctor, or --report-dir is "
                                         "not shared by the nodes"))
    nodes = [reports[r] for r in sorted(reports)]
    for r in nodes:
        for level, message in r["findings"]:
            if level != "ok":
                findings.append(Finding(level, f"{_node(r)}: {message}"))
    findings += _versions(nodes)
    for r in nodes:
        taken = [p for p, free in r["ports"].items() if not free]
        if taken:
            findings.append(Finding("error", f"{_node(r)}: port {', '.join(taken)} is in "
                                             "use; stop what holds it or give the job "
                                             "another --port"))
        if r["gpus"] and not r["ptxas"]:
            findings.append(Finding("warning", f"{r['host']}: no ptxas (XLA compiles GPU "
                                               "kernels with it): pip install "
                                               "nvidia-cuda-nvcc-cu12 or put CUDA's bin on "
                                               "PATH"))
    findings += _libdevice(nodes)
    findings += reachable(probed)
    nccl = _groups(nodes, lambda r: {k: r["nccl_env"].get(k) for k in
                                     sorted(set(NCCL_SETTINGS) | set(r["nccl_env"]))})
    if len(nccl) > 1:
        findings.append(Finding("warning", _differ("the NCCL settings", nccl)))
    if nodes:
        first = nodes[0]
        settings = ", ".join(f"{k}={first['nccl_env'].get(k, 'unset')}" for k in
                             NCCL_SETTINGS) if first["nccl_env"] else "no NCCL_* variable set"
        findings.append(Finding("ok", f"NCCL settings: {settings}"))
    if plan is not None:
        findings += (bandwidth(nodes, results or {}) if "jobs" in plan
                     else [Finding("ok", plan["skipped"])])
    if nodes:
        findings.append(Finding("ok", f"{len(nodes)} of {size} nodes reported: TensorFlow "
                                      f"{first['tensorflow']}, CUDA {first['cuda']}, cuDNN "
                                      f"{first['cudnn']}, NCCL {first['nccl']}, driver "
                                      f"{first['driver']}, GPUs: {_gpu_list(first['gpus'])}"))
    return findings


def _versions(nodes: Sequence[dict]) -> List[Finding]:
    found = []
    for key, level, name in (("tensorflow", "error", "TensorFlow"), ("cuda", "error", "CUDA"),
                             ("cudnn", "error", "cuDNN"), ("nccl", "error", "NCCL"),
                             ("driver", "warning", "driver")):
        groups = _groups(nodes, lambda r, k=key: str(r.get(k)))
        if len(groups) > 1:
            found.append(Finding(level, _differ(f"the {name} versions", groups)))
    gpus = _groups(nodes, lambda r: _gpu_list(r["gpus"]))
    if len(gpus) > 1:
        found.append(Finding("error", _differ("the GPUs", gpus)))
    return found


def _libdevice(nodes: Sequence[dict]) -> List[Finding]:
    """An error per GPU node without libdevice; the nodes that agree in one line."""
    found, ok = [], {}
    for r in nodes:
        if r.get("libdevice") is None:
            continue
        level, message = xla_files.libdevice_finding(r["libdevice"], _has_gpu(r))
        if level == "ok":
            ok.setdefault(message, []).append(_node(r))
        else:
            found.append(Finding(level, f"{_node(r)}: {message}"))
    return found + [Finding("ok", f"{message} on {_some(where)}")
                    for message, where in ok.items()]


def reachable(probed: Sequence[dict]) -> List[Finding]:
    """Client 0's connections to every rank's ports: an error naming each port it
    cannot reach, with the likely cause."""
    bad = [p for p in probed if p["error"]]
    found = [Finding("error", f"client 0 cannot reach {p['host']} (rank {p['rank']}) at "
                              f"{p['address']}:{p['port']}: {p['error'][0]}; likely "
                              f"{p['error'][1]}") for p in bad]
    if probed:
        ranks = len({p["rank"] for p in probed})
        found.append(Finding("ok", f"client 0 reached {len(probed) - len(bad)} of "
                                   f"{len(probed)} job ports of {ranks} ranks (bound as "
                                   "TensorFlow's gRPC server binds them)"))
    return found


def bandwidth(nodes: Sequence[dict], results: Dict[int, dict]) -> List[Finding]:
    """The all-reduce test's findings: failures per node, rank 0's bandwidths, each
    node's NCCL transports and the warnings on them."""
    found = []
    hosts = len({r["address"] for r in nodes})
    measured = None
    transports: Dict[str, List[str]] = {}
    for r in nodes:
        result = results.get(r["rank"])
        if result is None:
            found.append(Finding("error", f"{_node(r)} wrote no all-reduce result: its test "
                                          "hung or crashed (its output says why)"))
            continue
        if result.get("error"):
            found.append(Finding("error", f"{_node(r)}: {result['error']}"))
        elif measured is None:
            measured = result
        seen = result.get("transports") or {}
        text = ", ".join(f"{k} x {n}" for k, n in sorted(seen.items())) or "none logged"
        if result.get("network"):
            text += f" (network {result['network']})"
        transports.setdefault(text, []).append(_node(r))
        links = r.get("links") or {}
        for warning in nccl_log.transport_warnings(seen, bool(links.get("nvlink")),
                                                   links.get("ib") or [], hosts,
                                                   r.get("nccl_env", {})):
            found.append(Finding("warning", f"{_node(r)}: {warning}"))
    if measured:
        sizes = "; ".join(f"{x['bytes'] / MIB:g} MiB {x['algbw_gbs']:.1f} GB/s algorithm, "
                          f"{x['busbw_gbs']:.1f} GB/s bus" for x in measured["results"])
        found.append(Finding("ok", f"all-reduce over {measured['devices']} "
                                   f"{measured['device_type']}s (nccl-tests' convention: bus "
                                   f"= algorithm x 2(n-1)/n): {sizes}"))
    for text, where in transports.items():
        found.append(Finding("ok", f"NCCL transports: {text} on {_some(where)}"))
    return found
