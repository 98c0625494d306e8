"""The doctor for many nodes: every node's findings in one report.

`srun tfllm doctor --report-dir DIR` (or one `tfllm doctor --report-dir DIR` per rank of
a hostfile or Kubernetes job, with `--rank`/`--world-size` where no scheduler says them)
makes each rank write what it found on its node to `DIR/doctor.rank_R.json` (DIR must be
shared by the nodes, as a run's workdir is). Rank 0 waits for every rank's file and
prints one report:

* each node's own findings (the single-node checks of `tfllm.parallel.gpu_checks`),
  prefixed with its host;
* the versions a job needs equal on every node: TensorFlow, the CUDA and cuDNN it was
  built with, the NCCL library and the driver (an error where they differ, naming which
  node has which);
* the same GPUs (count and kind) everywhere;
* the job's ports free on every node (`--ports`, default the launcher's first port and
  the next ones, one per local rank);
* the NCCL settings each node has (`NCCL_SOCKET_IFNAME`, `NCCL_IB_HCA`, the P2P/SHM/NVLS
  switches and every other `NCCL_*`), a warning where nodes differ;
* XLA's `ptxas` and libdevice on GPU nodes.

The driver version is read through NVIDIA's management library (libnvidia-ml) where it
loads, else from nvidia-smi; `TFLLM_DRIVER_VERSION` overrides both (a CUDA
forward-compatibility container runs a newer user-mode driver than the host's kernel
module reports). Without a GPU none of those is read and the GPU checks say so; an
all-reduce bandwidth test is not part of this report (it needs GPUs and a mesh: run a
short `tfllm bench` on the job's mesh).
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import socket
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tfllm.parallel.gpu_checks import Finding, HostFacts

REPORT = "doctor.rank_{}.json"
#: the NCCL variables that decide the transport, listed even when unset
NCCL_SETTINGS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE",
                 "NCCL_NVLS_ENABLE", "NCCL_IB_DISABLE", "NCCL_NET_GDR_LEVEL")


def rank_and_size(env: Mapping[str, str], rank: Optional[int] = None,
                  size: Optional[int] = None) -> Tuple[int, int]:
    """This process's rank and the job's size: given, else Slurm's, Kubernetes Indexed
    Job's / mpirun's, else one process."""
    if rank is None:
        for key in ("SLURM_PROCID", "JOB_COMPLETION_INDEX", "OMPI_COMM_WORLD_RANK"):
            if str(env.get(key, "")).isdigit():
                rank = int(env[key])
                break
    if size is None:
        for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
            if str(env.get(key, "")).isdigit():
                size = int(env[key])
                break
    rank, size = rank or 0, size or 1
    if not 0 <= rank < size:
        raise ValueError(f"--rank {rank} is not below --world-size {size}.")
    return rank, size


def driver_version(facts: HostFacts, env: Mapping[str, str]) -> Optional[str]:
    """The NVIDIA driver's version: TFLLM_DRIVER_VERSION, else NVML, else nvidia-smi."""
    if env.get("TFLLM_DRIVER_VERSION"):
        return env["TFLLM_DRIVER_VERSION"]
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() == 0:
            buf = ctypes.create_string_buffer(96)
            if nvml.nvmlSystemGetDriverVersion(buf, 96) == 0:
                return buf.value.decode()
    except (OSError, AttributeError):
        pass
    return facts.driver_gpus[0].driver if facts.driver_gpus else None


def nccl_version() -> Optional[str]:
    """The version of the NCCL library TensorFlow's GPU build would open, or None."""
    try:
        import tensorflow as tf
        site = os.path.dirname(os.path.dirname(tf.__file__))
        found = glob.glob(os.path.join(site, "nvidia", "nccl", "lib", "libnccl.so.2"))
        lib = ctypes.CDLL(found[0] if found else "libnccl.so.2")
        code = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError, ImportError):
        return None
    v = code.value  # 2.18.3 is 21803 (NCCL_VERSION_CODE since 2.9)
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def ptxas() -> Optional[str]:
    """Where XLA's GPU compiler finds ptxas (PATH or the nvidia-cuda-nvcc wheel)."""
    found = shutil.which("ptxas")
    if found:
        return found
    try:
        import tensorflow as tf
        site = os.path.dirname(os.path.dirname(tf.__file__))
    except ImportError:
        return None
    hits = glob.glob(os.path.join(site, "nvidia", "cuda_nvcc", "bin", "ptxas"))
    return hits[0] if hits else None


def port_free(port: int) -> bool:
    """Whether a server may bind `port` on every interface (as TensorFlow's gRPC does,
    address reuse included, so ports of an ended job in TIME_WAIT count as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def node_report(facts: HostFacts, findings: Sequence[Finding], rank: int,
                ports: Sequence[int]) -> dict:
    """What one rank found on its node, as written to its report file."""
    env = facts.environ
    gpu = bool(facts.driver_gpus or facts.tf_gpus)
    return {
        "host": socket.gethostname(), "rank": rank, "tensorflow": facts.tf_version,
        "cuda": facts.build.get("cuda_version"), "cudnn": facts.build.get("cudnn_version"),
        "nccl": nccl_version() if gpu else None,
        "driver": driver_version(facts, env) if gpu else None,
        "gpus": sorted(f"{g.name} (sm_{g.compute_capability[0]}{g.compute_capability[1]})"
                       for g in facts.driver_gpus),
        "tf_gpus": facts.tf_gpus,
        "nccl_env": {k: v for k, v in sorted(env.items()) if k.startswith("NCCL_")},
        "ports": {str(p): port_free(p) for p in ports},
        "ptxas": ptxas() if gpu else None,
        "findings": [[f.level, f.message] for f in findings],
    }


def write_report(directory: str, report: dict) -> str:
    """Writes this rank's report into `directory` (whole or not at all)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, REPORT.format(report["rank"]))
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def wait_reports(directory: str, size: int, timeout_s: float,
                 since: float = 0.0) -> Dict[int, dict]:
    """Every rank's report in `directory` written after `since` (a stale one of an
    earlier job does not count), waiting up to `timeout_s` for the missing ones."""
    deadline = time.monotonic() + timeout_s
    reports: Dict[int, dict] = {}
    while True:
        for rank in range(size):
            if rank in reports:
                continue
            path = os.path.join(directory, REPORT.format(rank))
            try:
                if os.path.getmtime(path) + 1.0 < since:
                    continue
                with open(path, encoding="utf-8") as f:
                    reports[rank] = json.load(f)
            except (OSError, ValueError):
                continue
        if len(reports) == size or time.monotonic() > deadline:
            return reports
        time.sleep(0.2)


def _groups(reports: Sequence[dict], key) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for r in reports:
        out.setdefault(json.dumps(key(r)) if not isinstance(key(r), str) else key(r),
                       []).append(f"{r['host']} (rank {r['rank']})")
    return out


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


def compare(reports: Dict[int, dict], size: int, waited_s: float) -> List[Finding]:
    """The job's findings from every rank's report (see the module docstring)."""
    findings: List[Finding] = []
    missing = [r for r in range(size) if r not in reports]
    if missing:
        findings.append(Finding("error", f"ranks {', '.join(map(str, missing))} of {size} "
                                         f"wrote no report within {waited_s:g} s: their "
                                         "nodes did not run the doctor, or --report-dir is "
                                         "not shared by the nodes"))
    nodes = [reports[r] for r in sorted(reports)]
    for r in nodes:
        for level, message in r["findings"]:
            if level != "ok":
                findings.append(Finding(level, f"{r['host']} (rank {r['rank']}): {message}"))
    for key, level in (("tensorflow", "error"), ("cuda", "error"), ("cudnn", "error"),
                       ("nccl", "error"), ("driver", "warning")):
        groups = _groups(nodes, lambda r, k=key: str(r.get(k)))
        if len(groups) > 1:
            name = {"tensorflow": "TensorFlow", "cuda": "CUDA", "cudnn": "cuDNN",
                    "nccl": "NCCL", "driver": "driver"}[key]
            findings.append(Finding(level, _differ(f"the {name} versions", groups)))
    gpus = _groups(nodes, lambda r: _gpu_list(r["gpus"]))
    if len(gpus) > 1:
        findings.append(Finding("error", _differ("the GPUs", gpus)))
    for r in nodes:
        taken = [p for p, free in r["ports"].items() if not free]
        if taken:
            findings.append(Finding("error", f"{r['host']} (rank {r['rank']}): port "
                                             f"{', '.join(taken)} is in use; stop what holds "
                                             "it or give the job another --port"))
        if r["gpus"] and not r["ptxas"]:
            findings.append(Finding("warning", f"{r['host']}: no ptxas (XLA compiles GPU "
                                               "kernels with it): pip install "
                                               "nvidia-cuda-nvcc-cu12 or put CUDA's bin on "
                                               "PATH"))
    nccl = _groups(nodes, lambda r: {k: r["nccl_env"].get(k) for k in
                                     sorted(set(NCCL_SETTINGS) | set(r["nccl_env"]))})
    if len(nccl) > 1:
        findings.append(Finding("warning", _differ("the NCCL settings", nccl)))
    if nodes:
        first = nodes[0]
        settings = ", ".join(f"{k}={first['nccl_env'].get(k, 'unset')}" for k in
                             NCCL_SETTINGS) if first["nccl_env"] else "no NCCL_* variable set"
        findings.append(Finding("ok", f"NCCL settings: {settings}"))
        findings.append(Finding("ok", f"{len(nodes)} of {size} nodes reported: TensorFlow "
                                      f"{first['tensorflow']}, CUDA {first['cuda']}, cuDNN "
                                      f"{first['cudnn']}, NCCL {first['nccl']}, driver "
                                      f"{first['driver']}, GPUs: {_gpu_list(first['gpus'])}"))
    return findings
