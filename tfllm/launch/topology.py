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
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from tfllm.contracts import READY_FILE_ENV, READY_KEY_ENV
from tfllm.launch.device import DEVICE_ENV, NCCL_ENV, NCCL_PROBE_SH, resolve_device_env

#: default first port when ports are not picked free on this host
DEFAULT_PORT = 9991
#: variables passed to remote workers in hostfile mode unless --export says otherwise
#: (the user's explicit NCCL choice; the CUDA JIT cache that spares Hopper hosts minutes
#: of PTX compilation at each start)
DEFAULT_EXPORTS = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "KERAS_BACKEND",
                   "TF_CPP_MIN_LOG_LEVEL", "XLA_FLAGS", NCCL_ENV, "CUDA_CACHE_PATH",
                   "CUDA_CACHE_MAXSIZE")
EXPORT_PREFIXES = ("TFLLM_", "NCCL_")
#: secrets every worker needs: never put on a command line, which `ps` shows to every user
#: of a host (hostfile mode sends them on the remote shell's stdin, `secret_input`); the
#: workers of the other modes inherit them from the environment
SECRET_ENV = ("TFLLM_CHECKPOINT_KEY",)


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
    for host in hosts:
        if host.startswith("-"):  # ssh would read it as an option (-oProxyCommand=...)
            raise LaunchError(f"--hostfile '{path}': '{host}' is not a host name (it "
                              "starts with '-'); list one host name per line")
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
def fixed_ports(topology: Topology, first: Optional[int], per_rank: bool = False) -> List[int]:
    """Each rank's port: a host's workers use first, first+1, ... (all hosts agree); with
    `per_rank`, rank r uses first+r whatever its host (several host names of one machine,
    e.g. Slurm nodes that share a host, must not share a port: gRPC binds every interface)."""
    base = DEFAULT_PORT if first is None else first
    slots = range(topology.world_size) if per_rank else topology.local_ranks
    ports = [base + slot for slot in slots]
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
      host_setup: hostfile mode: POSIX shell commands the remote host runs before the
        command, for what only that host can decide (its GPUs).
    """

    rank: int
    host: str
    port: int
    env: Dict[str, str] = field(default_factory=dict)
    host_setup: List[str] = field(default_factory=list)


#: the option (or scheduler setting) that sets the workers per host, for errors
_WORKERS_OPTION = {"local": "--num-workers", "hostfile": "--gpus-per-host",
                   "slurm": "srun --ntasks-per-node", "env": "--hosts/--world-size"}


def pick_gpu(slot: int, workers_on_host: int, visible_gpus: Optional[str],
             gpu_count: Callable[[], int], task_bound: bool = False,
             option: str = "--num-workers") -> str:
    """The GPU of a --per-gpu worker, chosen on the host it runs on: an entry of the
    host's CUDA_VISIBLE_DEVICES when that is set (never a GPU outside it), else its slot.

    Args:
      slot: the worker's index among its host's workers.
      workers_on_host: how many workers the job puts on that host.
      visible_gpus: CUDA_VISIBLE_DEVICES there (None when unset; '' hides every GPU).
      gpu_count: the host's GPU count, asked only without a list (0: unknown, unchecked).
      task_bound: the launcher starts one worker (slurm, env), so a list of one GPU is
        the one a scheduler bound to this task (srun --gpus-per-task=1), whatever the slot.
      option: what sets the workers per host, named in the error.
    """
    if visible_gpus is not None:
        visible = visible_gpus.split(",") if visible_gpus else []
        if task_bound and len(visible) == 1:
            return visible[0]
        if workers_on_host > len(visible):
            raise LaunchError(f"--per-gpu: {workers_on_host} workers per host but "
                              f"CUDA_VISIBLE_DEVICES='{visible_gpus}' lists {len(visible)} "
                              f"GPU(s); start at most {len(visible)} per host ({option}) or "
                              "list more GPUs in CUDA_VISIBLE_DEVICES")
        return visible[slot]
    count = gpu_count()
    if count and workers_on_host > count:
        raise LaunchError(f"--per-gpu: {workers_on_host} workers per host but nvidia-smi "
                          f"lists {count} GPU(s) here; start at most {count} per host "
                          f"({option}) or set CUDA_VISIBLE_DEVICES to the GPUs to use")
    return str(slot)


def pick_gpu_sh(slot: int, workers_on_host: int) -> str:
    """`pick_gpu` (task_bound=False) as POSIX shell for a remote host (hostfile mode): the
    launcher's own CUDA_VISIBLE_DEVICES says nothing about another host's GPUs, so the
    remote host splits its own list, or counts its GPUs with nvidia-smi, and exports
    CUDA_VISIBLE_DEVICES; too few GPUs exit 2 with one line naming --gpus-per-host. A
    listing of 0 GPUs (a driver that fails) is left unchecked, as `pick_gpu` leaves it."""
    too_few = (f'{{ echo "--per-gpu: {workers_on_host} workers per host (--gpus-per-host) '
               f'but %s on $(uname -n) lists %s GPU(s); lower --gpus-per-host or %s" >&2; '
               'exit 2; }')
    return (
        'if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then '
        # Split at commas without globbing (set -f), as pick_gpu's str.split(",").
        'set -f; IFS=,; set -- $CUDA_VISIBLE_DEVICES; unset IFS; set +f; '
        f'[ $# -ge {workers_on_host} ] || '
        + too_few % ("CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES", "$#",
                     "list more GPUs in CUDA_VISIBLE_DEVICES there")
        + f'; shift {slot}; g=$1; '
        'elif command -v nvidia-smi >/dev/null 2>&1; then '
        'n=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU"); '
        f'[ "$n" -eq 0 ] || [ "$n" -ge {workers_on_host} ] || '
        + too_few % ("nvidia-smi", "$n", "set CUDA_VISIBLE_DEVICES there")
        + f'; g={slot}; else g={slot}; fi; export CUDA_VISIBLE_DEVICES=$g')


def worker_specs(topology: Topology, ports: Sequence[int], job_name: str = "worker",
                 device: str = "auto", per_gpu: bool = False, attempt: int = 0,
                 visible_gpus: Optional[str] = None,
                 ready_files: Optional[Mapping[int, str]] = None,
                 ready_keys: Optional[Mapping[int, str]] = None,
                 environ: Optional[Mapping[str, str]] = None,
                 gpu_count: Callable[[], int] = lambda: 0) -> List[WorkerSpec]:
    """The specs of the ranks this launcher starts.

    GPU questions (NCCL or not, which GPU) are answered on the worker's host. In local,
    slurm and env modes the launcher runs there and answers them itself
    (`device.resolve_device_env`, `pick_gpu`); in hostfile mode it never looks at its
    own host's GPUs: the remote host runs `host_setup` (`device.NCCL_PROBE_SH`,
    `pick_gpu_sh`) before the command.

    Args:
      device: --device: auto, gpu or cpu (TFLLM_DEVICE; gpu sets
        DTENSOR_GPU_USE_NCCL_COMMUNICATION=1, cpu 0, auto 1 where the host has GPUs).
      per_gpu: one process per GPU: CUDA_VISIBLE_DEVICES is the worker's GPU (`pick_gpu`).
      attempt: the restart count (MULTIWORKER_ATTEMPT).
      visible_gpus: CUDA_VISIBLE_DEVICES where the launcher runs (None: unset); unused
        in hostfile mode.
      ready_files: rank -> the path the worker creates once its mesh is up
        (TFLLM_READY_FILE, the readiness handshake on this host).
      ready_keys: rank -> a key the worker prints as `READY_LINE.format(key)` once its
        mesh is up (TFLLM_READY_KEY, the handshake of workers on other hosts).
      environ: the launcher's environment; a DTENSOR_GPU_USE_NCCL_COMMUNICATION set
        there is the user's and is passed on unchanged.
      gpu_count: this host's GPU count (nvidia-smi); never called in hostfile mode.
    """
    environ = environ if environ is not None else {}
    remote = topology.mode == "hostfile"
    jobs = ",".join(f"{h}:{p}" for h, p in zip(topology.hosts, ports))
    slots = topology.local_ranks
    specs = []
    for rank in topology.own_ranks:
        host = topology.hosts[rank]
        env = {"DTENSOR_JOBS": jobs, "DTENSOR_CLIENT_ID": str(rank),
               "DTENSOR_JOB_NAME": job_name, "MULTIWORKER_RANK": str(rank),
               "MULTIWORKER_WORLD_SIZE": str(topology.world_size),
               "MULTIWORKER_LOCAL_RANK": str(slots[rank]), "MULTIWORKER_ATTEMPT": str(attempt),
               DEVICE_ENV: device}
        setup = []
        if environ.get(NCCL_ENV):
            env[NCCL_ENV] = environ[NCCL_ENV]  # the user's choice, shown by --dry-run
        elif remote and device == "auto":
            setup.append(NCCL_PROBE_SH)
        else:
            env.update(resolve_device_env(env, gpu_count))
        if per_gpu:
            workers = topology.hosts.count(host)
            if remote:
                setup.append(pick_gpu_sh(slots[rank], workers))
            else:
                env["CUDA_VISIBLE_DEVICES"] = pick_gpu(
                    slots[rank], workers, visible_gpus, gpu_count,
                    task_bound=topology.mode in ("slurm", "env"),
                    option=_WORKERS_OPTION[topology.mode])
        if ready_files and rank in ready_files:
            env[READY_FILE_ENV] = ready_files[rank]
        if ready_keys and rank in ready_keys:
            env[READY_KEY_ENV] = ready_keys[rank]
        specs.append(WorkerSpec(rank, host, ports[rank], env, setup))
    return specs


def exported_names(environ: Mapping[str, str], names: Optional[str]) -> List[str]:
    """The variables hostfile mode passes on its command line: --export NAMES, else the
    defaults plus every TFLLM_* and NCCL_* variable set here; never a secret (`SECRET_ENV`,
    sent on stdin instead)."""
    chosen = ([n for n in names.split(",") if n] if names else list(DEFAULT_EXPORTS)
              + sorted(n for n in environ if n.startswith(EXPORT_PREFIXES)))
    return [n for n in chosen if n not in SECRET_ENV]


def secret_input(environ: Mapping[str, str]) -> Tuple[List[str], str]:
    """The secrets set here (`SECRET_ENV`), and the first lines of a remote shell's stdin
    that carry them (hostfile mode), one value per line: (names, text).

    Raises:
      LaunchError: a value holds a line break (it could not be read as one line).
    """
    names = [n for n in SECRET_ENV if environ.get(n)]
    for name in names:
        if "\n" in environ[name] or "\r" in environ[name]:
            raise LaunchError(f"{name} holds a line break; hostfile mode sends it to the "
                              "remote hosts as one line of input: use a value without one")
    return names, "".join(environ[n] + "\n" for n in names)


def remote_script(spec: WorkerSpec, command: Sequence[str], cwd: str,
                  exports: Mapping[str, str], secrets: Sequence[str] = ()) -> str:
    """The command a remote host runs for `spec` (over ssh, hostfile mode): `sh -c SCRIPT`.

    ssh hands the command to the user's login shell, which may be zsh (no word splitting
    of `$VAR`) or csh: the script itself runs under POSIX sh, whatever that shell is. The
    variables are exported before `spec.host_setup` runs, so the host's own decisions
    (NCCL, the GPU) see the worker's whole environment, an explicit setting included.
    The `secrets` (names) are read from the first lines of stdin (`secret_input`): only
    their names are on the command line, which `ps` shows on both hosts.
    ssh without a tty does not signal the remote command when the connection drops: a
    watcher kills the worker when the script's stdin (the local ssh's) reaches EOF.
    """
    assignments = " ".join(shlex.quote(f"{k}={v}")
                           for k, v in list(exports.items()) + list(spec.env.items()))
    reads = "".join(f"IFS= read -r {name} || exit 2; export {name}; " for name in secrets)
    setup = "".join(f"{line}; " for line in spec.host_setup)
    worker = " ".join(shlex.quote(word) for word in command)
    script = (f"cd {shlex.quote(cwd)} || exit 2; export {assignments}; {reads}{setup}"
              f"exec 3<&0; {worker} </dev/null 3<&- & p=$!; {{ read -r _ <&3; kill -TERM "
              "$p 2>/dev/null; } & w=$!; wait $p; rc=$?; kill $w 2>/dev/null; exit $rc")
    return "sh -c " + shlex.quote(script)


def command_workdir(command: Sequence[str]) -> Optional[str]:
    """The command's --workdir (its clients other than 0 log there), or None."""
    workdir = None
    for i, word in enumerate(command):
        if word == "--workdir" and i + 1 < len(command):
            workdir = command[i + 1]
        elif word.startswith("--workdir="):
            workdir = word[len("--workdir="):]
    # the command expands `~` itself (`--workdir=~/r` reaches it unexpanded): so does the
    # launcher, or the clients' logs would go to a folder named `~`
    return os.path.expanduser(workdir) if workdir else workdir
