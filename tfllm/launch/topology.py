"""Who runs where: the workers of one multi-client job, as pure functions.

DTensor's multi-client runtime needs, in every process, the list of all clients'
host:port (`DTENSOR_JOBS`, whose length is the client count), this process's index in
it (`DTENSOR_CLIENT_ID`) and a job name (`DTENSOR_JOB_NAME`). The functions here derive
them from the cluster's description (local processes, a SLURM allocation, a hostfile,
Kubernetes/MPI rank variables) without starting or probing anything, so that every
rule is unit-tested without processes. `tfllm.launch.supervisor` starts what they plan.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

#: exit code of bad arguments or environment (nothing was started)
EXIT_USAGE = 2
#: default first port when ports are not picked free on this host
DEFAULT_PORT = 9991
#: variables passed to remote workers in hostfile mode unless --export says otherwise
DEFAULT_EXPORTS = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "KERAS_BACKEND",
                   "TF_CPP_MIN_LOG_LEVEL", "XLA_FLAGS")
EXPORT_PREFIXES = ("TFLLM_", "NCCL_")


#: the line a worker prints once its mesh is up when given TFLLM_READY_KEY
READY_LINE = "tfllm: ready {}"


def announce_ready(environ: Mapping[str, str], out=None) -> None:
    """The worker's side of the readiness handshake (tfllm calls it once its mesh is up):
    creates TFLLM_READY_FILE and prints the TFLLM_READY_KEY line, whichever are set."""
    path = environ.get("TFLLM_READY_FILE")
    if path:
        with open(path + ".tmp", "w") as f:
            f.write(str(environ.get("DTENSOR_CLIENT_ID", "0")))
        os.replace(path + ".tmp", path)  # appears complete or not at all
    key = environ.get("TFLLM_READY_KEY")
    if key:
        # The process's real stdout: the launcher reads it even where tfllm sends its
        # progress of clients other than 0 to a log file.
        print(READY_LINE.format(key), file=out or sys.__stdout__, flush=True)


class LaunchError(ValueError):
    """Bad arguments or environment: the message names the option or variable and the fix."""


@dataclass(frozen=True)
class Topology:
    """Every worker's host, and which of them this launcher starts.

    Args:
      hosts: rank r's host at index r (the client count is its length).
      own_ranks: the ranks this launcher process starts (all in local and hostfile
        modes, its own one under slurm and env).
      mode: local, slurm, hostfile or env.
    """

    hosts: List[str]
    own_ranks: List[int]
    mode: str

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def local_ranks(self) -> List[int]:
        """Each rank's slot on its host: its port offset and, per GPU, its GPU."""
        seen: Dict[str, int] = {}
        slots = []
        for host in self.hosts:
            slots.append(seen.get(host, 0))
            seen[host] = slots[-1] + 1
        return slots


# ---- SLURM ---------------------------------------------------------------------------------
def _split_top(text: str) -> List[str]:
    """Splits at commas outside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current] if current else parts


def _expand_item(item: str) -> List[str]:
    match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not match:
        return [item]
    head, ranges, tail = match.groups()
    out = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        high = high or low
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise LaunchError(f"cannot expand nodelist range '{part}' in '{item}'")
        for n in range(int(low), int(high) + 1):
            # SLURM keeps each range's zero padding: node[01-02] -> node01, node02.
            out += [head + str(n).zfill(len(low)) + rest for rest in _expand_item(tail)]
    return out


def expand_nodelist(nodelist: str) -> List[str]:
    """A SLURM nodelist's hostnames: 'node[01-03,07],gpu1' -> node01 node02 node03 node07
    gpu1 (ranges nested left to right, zero padding kept, as `scontrol show hostnames`)."""
    return [host for item in _split_top(nodelist) for host in _expand_item(item)]


def expand_tasks_per_node(text: str) -> List[int]:
    """SLURM's tasks per node, one count per node: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)\(x(\d+)\)", part)
        if match:
            counts += [int(match.group(1))] * int(match.group(2))
        elif part.isdigit():
            counts.append(int(part))
        else:
            raise LaunchError(f"cannot parse SLURM tasks per node '{text}' (expected e.g. "
                              "'8(x4)' or '2,1')")
    return counts


# ---- the four modes --------------------------------------------------------------------------
def local_topology(num_workers: int) -> Topology:
    if num_workers < 1:
        raise LaunchError(f"--num-workers must be at least 1, got '{num_workers}'")
    return Topology(["localhost"] * num_workers, list(range(num_workers)), "local")


def slurm_topology(env: Mapping[str, str], nodes: Optional[Sequence[str]] = None) -> Topology:
    """The job of the srun task described by `env` (SLURM_PROCID of SLURM_NTASKS).

    Args:
      env: the task's environment.
      nodes: the expanded nodelist when already known (scontrol), else expanded here.
    """
    for var in ("SLURM_PROCID", "SLURM_NTASKS"):
        if not env.get(var):
            raise LaunchError(f"--mode slurm: {var} is not set; run under srun inside an "
                              "allocation (srun ... --mode slurm -- ...), or use --mode "
                              "local/env")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("--mode slurm: neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST "
                          "is set; run under srun")
    nodes = list(nodes) if nodes is not None else expand_nodelist(nodelist)
    ntasks = _whole("SLURM_NTASKS", env["SLURM_NTASKS"], minimum=1)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    counts = (expand_tasks_per_node(per_node) if per_node
              else [ntasks // len(nodes)] * len(nodes))
    if len(counts) != len(nodes):
        raise LaunchError(f"--mode slurm: {len(nodes)} nodes ({nodelist}) but tasks per node "
                          f"'{per_node}' has {len(counts)} entries")
    hosts = [node for node, count in zip(nodes, counts) for _ in range(count)]
    if len(hosts) != ntasks:
        raise LaunchError(f"--mode slurm: the tasks per node add up to {len(hosts)}, not "
                          f"SLURM_NTASKS={ntasks}; use srun's default block distribution")
    rank = _whole("SLURM_PROCID", env["SLURM_PROCID"])
    if rank >= ntasks:
        raise LaunchError(f"--mode slurm: SLURM_PROCID={rank} is not below "
                          f"SLURM_NTASKS={ntasks}")
    return Topology(hosts, [rank], "slurm")


def parse_hostfile(text: str, path: str = "hostfile") -> List[str]:
    """Hosts of a hostfile: the first word of each line; '#' comments and blanks ignored."""
    hosts = [line.split("#", 1)[0].split()[0] for line in text.splitlines()
             if line.split("#", 1)[0].split()]
    if not hosts:
        raise LaunchError(f"--hostfile '{path}' lists no hosts")
    return hosts


def hostfile_topology(hosts: Sequence[str], slots_per_host: int = 1) -> Topology:
    ranks = [host for host in hosts for _ in range(slots_per_host)]
    return Topology(ranks, list(range(len(ranks))), "hostfile")


def env_topology(env: Mapping[str, str], rank: Optional[str] = None,
                 world_size: Optional[str] = None, hosts: Optional[str] = None,
                 host_pattern: Optional[str] = None) -> Topology:
    """A process whose rank and world size the caller gives: --rank/--world-size, else
    JOB_COMPLETION_INDEX (Kubernetes Indexed Job) or OMPI_COMM_WORLD_RANK/SIZE (mpirun).

    Args:
      hosts: 'h0,h1,...': one host per rank, or one per node when the world size is a
        multiple (ranks fill a node's slots in order).
      host_pattern: hosts from a pattern, '{rank}' replaced by 0..N-1.
    """
    rank = rank if rank is not None else (env.get("JOB_COMPLETION_INDEX")
                                          or env.get("OMPI_COMM_WORLD_RANK"))
    world_size = world_size if world_size is not None else env.get("OMPI_COMM_WORLD_SIZE")
    if rank is None or rank == "":
        raise LaunchError("--mode env: no rank; give --rank, or set JOB_COMPLETION_INDEX "
                          "(Kubernetes Indexed Job) or OMPI_COMM_WORLD_RANK (mpirun)")
    if world_size is None or world_size == "":
        raise LaunchError("--mode env: no world size; give --world-size (e.g. the Job's "
                          "completions) or set OMPI_COMM_WORLD_SIZE")
    if not str(world_size).isdigit() or int(world_size) < 1:
        raise LaunchError(f"--world-size must be at least 1, got '{world_size}'")
    world = int(world_size)
    if not str(rank).isdigit() or int(rank) >= world:
        raise LaunchError(f"--rank must be in 0..{world - 1}, got '{rank}'")
    if hosts and host_pattern:
        raise LaunchError("give --hosts or --host-pattern, not both")
    if host_pattern:
        names = [host_pattern.replace("{rank}", str(r)) for r in range(world)]
    elif hosts:
        names = hosts.split(",")
    else:
        raise LaunchError("--mode env needs the hosts: --hosts h0,h1,... or --host-pattern "
                          "'name-{rank}.service'")
    if world % len(names):
        raise LaunchError(f"--hosts has {len(names)} entries; give one per rank ({world}) or "
                          f"one per node (a divisor of {world})")
    per_node = world // len(names)
    return Topology([h for h in names for _ in range(per_node)], [int(rank)], "env")


def _whole(name: str, value: str, minimum: int = 0) -> int:
    if not str(value).isdigit() or int(value) < minimum:
        raise LaunchError(f"{name} must be a whole number >= {minimum}, got '{value}'")
    return int(value)


# ---- ports and environments -------------------------------------------------------------------
def fixed_ports(topology: Topology, first: Optional[int]) -> List[int]:
    """Each rank's port: a host's workers use first, first+1, ... (all hosts agree)."""
    base = DEFAULT_PORT if first is None else first
    ports = [base + slot for slot in topology.local_ranks]
    if ports and max(ports) > 65535:
        raise LaunchError(f"--port {base} + workers per host exceeds 65535")
    return ports


@dataclass
class WorkerSpec:
    """One worker process: its rank, where it runs and the environment it gets.

    Args:
      rank: DTENSOR_CLIENT_ID.
      host: where it runs.
      port: its DTensor port.
      env: the variables the launcher sets for it (on top of the inherited ones).
    """

    rank: int
    host: str
    port: int
    env: Dict[str, str] = field(default_factory=dict)


def worker_specs(topology: Topology, ports: Sequence[int], job_name: str = "worker",
                 device: str = "cpu", per_gpu: bool = False, attempt: int = 0,
                 visible_gpus: Optional[str] = None,
                 ready_files: Optional[Mapping[int, str]] = None,
                 ready_keys: Optional[Mapping[int, str]] = None) -> List[WorkerSpec]:
    """The specs of the ranks this launcher starts.

    Args:
      device: "gpu" sets DTENSOR_GPU_USE_NCCL_COMMUNICATION=1.
      per_gpu: one process per GPU: CUDA_VISIBLE_DEVICES is the worker's GPU (the
        local-rank-th entry of `visible_gpus` when the scheduler already bound a list,
        its only entry when it bound one, else the local rank).
      attempt: the restart count (MULTIWORKER_ATTEMPT).
      ready_files: rank -> the path the worker creates once its mesh is up
        (TFLLM_READY_FILE, the readiness handshake on this host).
      ready_keys: rank -> a key the worker prints as `READY_LINE.format(key)` once its
        mesh is up (TFLLM_READY_KEY, the handshake of workers on other hosts).
    """
    jobs = ",".join(f"{h}:{p}" for h, p in zip(topology.hosts, ports))
    slots = topology.local_ranks
    specs = []
    for rank in topology.own_ranks:
        env = {"DTENSOR_JOBS": jobs, "DTENSOR_CLIENT_ID": str(rank),
               "DTENSOR_JOB_NAME": job_name, "MULTIWORKER_RANK": str(rank),
               "MULTIWORKER_WORLD_SIZE": str(topology.world_size),
               "MULTIWORKER_LOCAL_RANK": str(slots[rank]), "MULTIWORKER_ATTEMPT": str(attempt)}
        if device == "gpu":
            env["DTENSOR_GPU_USE_NCCL_COMMUNICATION"] = "1"
        if per_gpu:
            gpu = str(slots[rank])
            if topology.mode != "hostfile" and visible_gpus:
                visible = visible_gpus.split(",")
                gpu = visible[0] if len(visible) == 1 else (
                    visible[slots[rank]] if slots[rank] < len(visible) else gpu)
            env["CUDA_VISIBLE_DEVICES"] = gpu
        if ready_files and rank in ready_files:
            env["TFLLM_READY_FILE"] = ready_files[rank]
        if ready_keys and rank in ready_keys:
            env["TFLLM_READY_KEY"] = ready_keys[rank]
        specs.append(WorkerSpec(rank, topology.hosts[rank], ports[rank], env))
    return specs


def exported_names(environ: Mapping[str, str], names: Optional[str]) -> List[str]:
    """The variables hostfile mode passes on: --export NAMES, else the defaults plus
    every TFLLM_* and NCCL_* variable set here."""
    if names:
        return [n for n in names.split(",") if n]
    return list(DEFAULT_EXPORTS) + sorted(n for n in environ if n.startswith(EXPORT_PREFIXES))


def remote_script(spec: WorkerSpec, command: Sequence[str], cwd: str,
                  exports: Mapping[str, str]) -> str:
    """The shell script a remote host runs for `spec` (over ssh, hostfile mode).

    ssh without a tty does not signal the remote command when the connection drops: a
    watcher kills the worker when the script's stdin (the local ssh's) reaches EOF.
    """
    assignments = " ".join(shlex.quote(f"{k}={v}")
                           for k, v in list(exports.items()) + list(spec.env.items()))
    worker = " ".join(shlex.quote(word) for word in command)
    return (f"cd {shlex.quote(cwd)} || exit 2; exec 3<&0; env {assignments} {worker} "
            "</dev/null 3<&- & p=$!; { read -r _ <&3; kill -TERM $p 2>/dev/null; } & w=$!; "
            "wait $p; rc=$?; kill $w 2>/dev/null; exit $rc")


def command_workdir(command: Sequence[str]) -> Optional[str]:
    """The command's --workdir (its clients other than 0 log there), or None."""
    workdir = None
    for i, word in enumerate(command):
        if word == "--workdir" and i + 1 < len(command):
            workdir = command[i + 1]
        elif word.startswith("--workdir="):
            workdir = word[len("--workdir="):]
    return workdir
