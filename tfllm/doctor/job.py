"""The doctor for many nodes: every node's findings in one report.

`srun tfllm doctor --report-dir DIR` (or one `tfllm doctor --report-dir DIR` per rank of
a hostfile or Kubernetes job, with `--rank`/`--world-size` where no scheduler says them,
or `tfllm launch ... -- tfllm doctor --report-dir DIR`, which gives the job's own ports)
makes each rank write what it found on its node to `DIR/doctor.rank_R.json` (DIR must be
shared by the nodes, as a run's workdir is). Rank 0 waits for every rank's file and
prints one report:

* each node's own findings (the single-node checks of `tfllm.runtime.gpu_checks`),
  prefixed with its host;
* the versions a job needs equal on every node: TensorFlow, the CUDA and cuDNN it was
  built with, the NCCL library and the driver (an error where they differ, naming which
  node has which);
* the same GPUs (count and kind) everywhere;
* the job's ports (`--ports`, default the launcher's: `DTENSOR_JOBS`'s under `tfllm
  launch`, else its first port and the next ones, one per local rank) free on every node,
  and reachable from client 0: each rank listens on them while the doctor runs, bound as
  TensorFlow's gRPC server binds them (`tfllm.launch.ports`), and rank 0 connects to every
  rank's address (the host the launcher would name: the Slurm node, the `DTENSOR_JOBS`
  entry, else the host name) and port; an unreachable one is named with the likely cause;
* the NCCL settings each node has (`NCCL_SOCKET_IFNAME`, `NCCL_IB_HCA`, the P2P/SHM/NVLS
  switches and every other `NCCL_*`), a warning where nodes differ;
* XLA's `ptxas` and libdevice (`tfllm.doctor.xla_files`): an error on a GPU node without
  libdevice, a note on CPU nodes;
* on GPU nodes, once every port answered, a short all-reduce over every GPU of the job
  (`tfllm.doctor.allreduce`: DTensor with NCCL, as a run) with its algorithm and bus
  bandwidth, and the transport NCCL picked on each node read from NCCL's log, with a
  warning where it is sockets or shared memory though NVLink or InfiniBand exist
  (`tfllm.doctor.nccl_log`). Without GPUs it is skipped and the report says so.

The driver version is read through NVIDIA's management library (libnvidia-ml) where it
loads, else from nvidia-smi; `TFLLM_DRIVER_VERSION` overrides both (a CUDA
forward-compatibility container runs a newer user-mode driver than the host's kernel
module reports). Without a GPU none of those is read and the GPU checks say so.

The ranks meet through files in DIR: rank 0 writes `doctor.go.json` once it has probed
every port (the other ranks keep listening until then), naming each rank's run (a random
nonce per rank, so that files of an earlier doctor are never taken for this one's) and
the bandwidth test's plan; each rank writes `doctor.allreduce_R.json` after the test.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import secrets
import socket
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tfllm import files
from tfllm.confined import read_regular
from tfllm.doctor import allreduce, nccl_log, xla_files
from tfllm.doctor.findings import NCCL_SETTINGS, compare  # noqa: F401  (the doctor's API)
from tfllm.launch import ports as job_ports
from tfllm.launch.topology import DEFAULT_PORT, LaunchError, slurm_topology
from tfllm.runpaths import DOCTOR_REPORT
from tfllm.runtime.gpu_checks import Finding, HostFacts

REPORT = DOCTOR_REPORT
GO = "doctor.go.json"
#: the most a rank's report (or go file, bandwidth result) may hold: a few KiB is usual
MAX_RECORD_BYTES = 1 << 20
ALLREDUCE = "doctor.allreduce_{}.json"
#: how long the other ranks keep listening after --wait-s (rank 0 probes every port)
PROBE_MARGIN_S = 60
#: the bandwidth test's limit (a cold start of TensorFlow on GPUs JIT-compiles its PTX
#: for minutes when the CUDA cache is empty)
ALLREDUCE_TIMEOUT_S = 900


def rank_and_size(env: Mapping[str, str], rank: Optional[int] = None,
                  size: Optional[int] = None) -> Tuple[int, int]:
    """This process's rank and the job's size: given, else the launcher's (DTENSOR_CLIENT_ID
    of DTENSOR_JOBS), Slurm's, Kubernetes Indexed Job's / mpirun's, else one process."""
    jobs = [j for j in env.get("DTENSOR_JOBS", "").split(",") if j]
    if jobs and rank is None and str(env.get("DTENSOR_CLIENT_ID", "")).isdigit():
        rank = int(env["DTENSOR_CLIENT_ID"])
        size = len(jobs) if size is None else size
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


def job_address(env: Mapping[str, str], rank: int) -> str:
    """The name client 0 reaches `rank` by, as the launcher would give it: its
    `DTENSOR_JOBS` entry, else its Slurm node, else this host's name."""
    jobs = [j for j in env.get("DTENSOR_JOBS", "").split(",") if j]
    if rank < len(jobs):
        return jobs[rank].rsplit(":", 1)[0]
    if env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        try:
            return slurm_topology(env).hosts[rank]
        except (LaunchError, IndexError):
            pass
    return socket.gethostname()


def node_ports(env: Mapping[str, str], rank: int, given: Optional[str]) -> List[int]:
    """The job's ports on this node: `given` ("P1,P2,..."), else this rank's
    `DTENSOR_JOBS` port, else the launcher's first port and one more per task of the
    node. Raises ValueError for a bad list."""
    if given:
        found = [int(p) for p in given.split(",")]
        if any(not 0 <= p <= 65535 for p in found):
            raise ValueError(f"--ports {given}: ports are 0-65535")
        return found
    jobs = [j for j in env.get("DTENSOR_JOBS", "").split(",") if j]
    if rank < len(jobs):
        return [int(jobs[rank].rsplit(":", 1)[1])]
    per_node = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or "1"
    return [DEFAULT_PORT + i for i in range(int(per_node))]


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


def node_report(facts: HostFacts, findings: Sequence[Finding], rank: int,
                ports: Sequence[int]) -> dict:
    """What one rank found on its node, as written to its report file (`run` adds the
    ports it listens on and its nonce)."""
    env = facts.environ
    gpu = bool(facts.driver_gpus or facts.tf_gpus)
    tf_dir = xla_files.tensorflow_dir()
    reuse = job_ports.reuse_port(env)
    return {
        "host": socket.gethostname(), "rank": rank, "tensorflow": facts.tf_version,
        "cuda": facts.build.get("cuda_version"), "cudnn": facts.build.get("cudnn_version"),
        "nccl": nccl_version() if gpu else None,
        "driver": driver_version(facts, env) if gpu else None,
        "gpus": sorted(f"{g.name} (sm_{g.compute_capability[0]}{g.compute_capability[1]})"
                       for g in facts.driver_gpus),
        "tf_gpus": facts.tf_gpus,
        "nccl_env": {k: v for k, v in sorted(env.items()) if k.startswith("NCCL_")},
        "ports": {str(p): job_ports.port_free(p, reuse) for p in ports},
        "address": job_address(env, rank),
        "ptxas": xla_files.ptxas(env, tf_dir) if gpu else None,
        "libdevice": xla_files.libdevice(env, tf_dir),
        "links": nccl_log.host_links() if facts.driver_gpus else None,
        "findings": [[f.level, f.message] for f in findings],
    }


def write_json(directory: str, name: str, record: dict) -> str:
    """Writes `record` as `directory/name`, whole or not at all (the doctor's one write:
    reports, the go file, the bandwidth results)."""
    path = os.path.join(directory, name)
    files.write_atomically(directory, path, json.dumps(record, indent=1, sort_keys=True),
                           suffix=f".{os.getpid()}.part")
    return path


def write_report(directory: str, report: dict) -> str:
    """Writes this rank's report into `directory` (whole or not at all)."""
    return write_json(directory, REPORT.format(report["rank"]), report)


def _read_json(path: str) -> Optional[dict]:
    """Another rank's JSON record, or None when missing, unreadable or no JSON object (a
    list, a number: no report of a tfllm doctor, counted as missing)."""
    try:
        record = json.loads(read_regular(path, MAX_RECORD_BYTES, "a doctor's report"))
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


_STR, _OPT_STR = (str,), (str, type(None))
#: what `findings.compare` and the probes read of a report, and the types they take
REPORT_FIELDS = {"host": _STR, "rank": (int,), "address": _STR, "findings": (list,),
                 "ports": (dict,), "gpus": (list,), "nccl_env": (dict,),
                 "listening": (list,), "tensorflow": _OPT_STR, "cuda": _OPT_STR,
                 "cudnn": _OPT_STR, "nccl": _OPT_STR, "driver": _OPT_STR}


def report_problem(record) -> Optional[str]:
    """What makes `record` (another rank's parsed report) no tfllm doctor report, or
    None: every field the job's comparison reads, with its type."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for key, types in REPORT_FIELDS.items():
        if not isinstance(record.get(key), types) or isinstance(record.get(key), bool) \
                and bool not in types:
            return f"field {key!r} missing or not {' or '.join(t.__name__ for t in types)}"
    if not all(isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f)
               for f in record["findings"]):
        return "field 'findings' is not a list of [level, message] strings"
    if not all(isinstance(k, str) and isinstance(v, bool) for k, v in record["ports"].items()):
        return "field 'ports' is not an object of port: free (true or false)"
    if not all(isinstance(g, str) for g in record["gpus"]) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in record["nccl_env"].items()):
        return "field 'gpus' or 'nccl_env' holds something other than strings"
    if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536
               for p in record["listening"]):
        return "field 'listening' is not a list of ports"
    return None


def _read_report(path: str):
    """(report, None), (None, what is wrong with the file) or (None, None) while it is
    missing or unreadable (still being written, or not yet there)."""
    try:
        text = read_regular(path, MAX_RECORD_BYTES, "a doctor's report")
    except (OSError, ValueError):
        return None, None
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as e:  # a partial write is renamed whole: final
        return None, f"no JSON ({str(e).splitlines()[0][:80]})"
    problem = report_problem(record)
    return (record, None) if problem is None else (None, problem)


def wait_reports(directory: str, size: int, timeout_s: float,
                 since: float = 0.0, invalid: Optional[Dict[int, str]] = None
                 ) -> Dict[int, dict]:
    """Every rank's report in `directory` written after `since` (a stale one of an
    earlier job does not count), waiting up to `timeout_s` for the missing ones.

    Args:
      invalid: filled with rank -> "PATH: what is wrong" for a report file that is no
        tfllm doctor report (`report_problem`); such a rank is not waited for.
    """
    deadline = time.monotonic() + timeout_s
    reports: Dict[int, dict] = {}
    invalid = {} if invalid is None else invalid
    while True:
        for rank in range(size):
            path = os.path.join(directory, REPORT.format(rank))
            try:
                fresh = rank not in reports and os.path.getmtime(path) + 1.0 >= since
            except OSError:
                continue
            found, problem = _read_report(path) if fresh else (None, None)
            if found is not None:
                reports[rank] = found
                invalid.pop(rank, None)
            elif problem is not None:
                invalid[rank] = f"{path}: {problem}"
        if len(reports) + len(invalid) == size or time.monotonic() > deadline:
            return reports
        time.sleep(0.2)


def _wait_for(directory: str, names: Dict[int, str], nonces: Dict[int, str],
              timeout_s: float) -> Dict[int, dict]:
    """{rank: record} of the files `names[rank]` whose "nonce" is `nonces[rank]` (this
    doctor's, not an earlier one's), waiting up to `timeout_s` for all."""
    deadline = time.monotonic() + timeout_s
    found: Dict[int, dict] = {}
    while True:
        for rank, name in names.items():
            record = None if rank in found else _read_json(os.path.join(directory, name))
            if record is not None and record.get("nonce") == nonces.get(rank):
                found[rank] = record
        if len(found) == len(names) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def greeting(rank: int, nonce: str) -> bytes:
    """What rank `rank`'s listeners answer: client 0 checks it reached that process."""
    return f"tfllm-doctor rank {rank} {nonce}\n".encode()


def reachability(reports: Dict[int, dict]) -> List[dict]:
    """Client 0 connects to every rank's address and listening ports: one record per
    port, {"rank", "host", "address", "port", "error": None or [what, likely cause]}."""
    targets = [(rank, r, port) for rank, r in sorted(reports.items())
               for port in r.get("listening", [])]
    errors = job_ports.probe_all([(r["address"], port, greeting(rank, r.get("nonce", "")))
                                  for rank, r, port in targets])
    return [{"rank": rank, "host": r["host"], "address": r["address"], "port": port,
             "error": list(error) if error else None}
            for (rank, r, port), error in zip(targets, errors)]


def bandwidth_plan(reports: Dict[int, dict], size: int, probed: Sequence[dict]) -> dict:
    """{"jobs": DTENSOR_JOBS of the all-reduce test} when every node has GPUs TensorFlow
    uses and answered on a port, else {"skipped": why}."""
    nodes = [reports[r] for r in sorted(reports)]
    if not any(r.get("tf_gpus") for r in nodes):
        return {"skipped": "no GPU: bandwidth test skipped"}
    if len(nodes) < size:
        return {"skipped": "ranks are missing: bandwidth test skipped"}
    without = [f"{r['host']} (rank {r['rank']})" for r in nodes if not r.get("tf_gpus")]
    if without:
        return {"skipped": f"TensorFlow uses no GPU on {', '.join(without[:3])}: "
                           "bandwidth test skipped"}
    answered = {p["rank"] for p in probed if not p["error"]}
    silent = [r for r in sorted(reports) if r not in answered]
    if silent:
        return {"skipped": f"client 0 cannot reach rank {', '.join(map(str, silent))} on "
                           "any port: bandwidth test skipped"}
    port = {p["rank"]: p["port"] for p in reversed(probed) if not p["error"]}
    return {"jobs": ",".join(f"{reports[r]['address']}:{port[r]}" for r in sorted(reports))}


def run(directory: str, facts: HostFacts, findings: Sequence[Finding], rank: int,
        size: int, ports: Sequence[int], wait_s: float) -> List[Finding]:
    """One rank's doctor (see the module docstring): its report written, its ports
    listened on until rank 0 probed them, the bandwidth test when rank 0 plans one.

    Args:
      directory: the folder the nodes share (--report-dir).
      facts, findings: this node's facts and single-host findings.
      rank, size: this rank and the job's ranks.
      ports: the job's ports on this node (0: a free one).
      wait_s: how long rank 0 waits for the other reports.

    Returns:
      On rank 0 the job's findings; on the others what this rank did.
    """
    nonce = secrets.token_hex(8)
    report = node_report(facts, findings, rank, ports)  # ports checked free, then bound
    started = time.time()
    reports, probed, plan = {}, [], {"skipped": "bandwidth test not planned"}
    with job_ports.Listeners(ports, greeting(rank, nonce),
                             job_ports.reuse_port(facts.environ)) as heard:
        report.update(listening=heard.listening, nonce=nonce)
        path = write_report(directory, report)
        if rank == 0:
            invalid: Dict[int, str] = {}
            reports = wait_reports(directory, size, wait_s, since=started - 300,
                                   invalid=invalid)
            probed = reachability(reports)
            plan = bandwidth_plan(reports, size, probed)
            nonces = {str(r): rep.get("nonce") for r, rep in reports.items()}
            write_json(directory, GO, {"nonce": nonce, "nonces": nonces, "bandwidth": plan})
        else:
            go = _wait_for_go(directory, rank, nonce, wait_s + PROBE_MARGIN_S)
            if go is None:
                return [Finding("ok", f"rank {rank} wrote {path}"),
                        Finding("warning", f"rank 0 probed no port of rank {rank} within "
                                           f"{wait_s + PROBE_MARGIN_S:g} s (rank 0's report "
                                           "says why)")]
            plan = go["bandwidth"]
    # The listeners are closed: the all-reduce's runtime binds the same ports.
    if "jobs" in plan:
        result = allreduce.run_client(plan["jobs"], rank, facts.environ, ALLREDUCE_TIMEOUT_S)
        write_json(directory, ALLREDUCE.format(rank), dict(result, nonce=nonce))
    if rank != 0:
        return [Finding("ok", f"rank {rank} wrote {path}")]
    results = {}
    if "jobs" in plan:
        results = _wait_for(directory, {r: ALLREDUCE.format(r) for r in reports},
                            {r: rep.get("nonce") for r, rep in reports.items()},
                            PROBE_MARGIN_S)
    return [Finding("error", f"rank {r}'s report is no tfllm doctor report ({why}): run "
                             "the same tfllm's doctor on that node, and give each job a "
                             "--report-dir of its own")
            for r, why in sorted(invalid.items())] + \
        compare(reports, size, wait_s, probed, plan, results, invalid=set(invalid))


def _wait_for_go(directory: str, rank: int, nonce: str, timeout_s: float) -> Optional[dict]:
    """Rank 0's go file once it names this rank's nonce (rank 0 probed its ports)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        go = _read_json(os.path.join(directory, GO))
        if go and go.get("nonces", {}).get(str(rank)) == nonce:
            return go
        time.sleep(0.2)
    return None
