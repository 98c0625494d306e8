"""`tfllm launch` (and `launch/multiworker.sh`): options, then plan and supervise the job.

Imports nothing heavy: the launcher runs on login nodes and inside containers before
TensorFlow is needed, and its argument errors must be immediate.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from tfllm import files
from tfllm.contracts import BAD_INPUT_EXIT_CODE
from tfllm.launch import device as dev
from tfllm.launch import scheduler
from tfllm.launch import supervisor as sup
from tfllm.launch import topology as topo
# REUSE_PORT_ENV makes TensorFlow's gRPC server bind with SO_REUSEPORT: it may then share
# a port the launcher holds (`Ports`)
from tfllm.launch.ports import REUSE_PORT_ENV, port_free
from tfllm.launch.topology import LaunchError
from tfllm.runpaths import LaunchLogs, RunPaths

USAGE = """\
Usage: {prog} --mode MODE [options] -- COMMAND [ARGS...]

Starts one COMMAND (e.g. `tfllm train --config c.yaml --workdir runs/x`) per host, or per
GPU with --per-gpu, with DTensor's multi-client environment set:
  DTENSOR_JOBS=host0:port0,host1:port1,...   one entry per worker (process)
  DTENSOR_CLIENT_ID=<rank>   DTENSOR_JOB_NAME=<--job-name>
  TFLLM_DEVICE=<--device>                    auto, gpu or cpu
  DTENSOR_GPU_USE_NCCL_COMMUNICATION=1|0     1 on GPU hosts, 0 with --device cpu
  CUDA_VISIBLE_DEVICES=<one GPU>             with --per-gpu
  MULTIWORKER_RANK, MULTIWORKER_WORLD_SIZE, MULTIWORKER_LOCAL_RANK, MULTIWORKER_ATTEMPT
  TFLLM_READY_FILE=<LOG_DIR/ready.RANK>      created by tfllm once its mesh is up
  TFLLM_READY_KEY=<key>                      hostfile: tfllm prints "tfllm: ready <key>"
Each worker's output is printed as "[rank N] ..." and saved to LOG_DIR/rank_N.log. If a
worker exits non-zero all are stopped (SIGTERM, SIGKILL after --kill-timeout).

Modes (--mode):
  local     --num-workers N processes on this host (ports: free ones, held by the launcher
            until the workers bind them with TF_GRPC_REUSE_PORT=1; or --port, --port+1..).
  slurm     inside an allocation, once per srun task (srun ... {prog} --mode slurm):
            rank SLURM_PROCID of SLURM_NTASKS; hosts from SLURM_STEP_NODELIST (else
            SLURM_JOB_NODELIST) and SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE),
            block distribution. This task starts only its own worker.
  hostfile  --hostfile FILE, one host per line (# comments, blank lines ignored); every
            worker is started from here over --ssh. Ranks follow the file order.
  env       the caller gives rank and world size: --rank/--world-size, else
            JOB_COMPLETION_INDEX (Kubernetes Indexed Job) or OMPI_COMM_WORLD_RANK /
            OMPI_COMM_WORLD_SIZE (mpirun); hosts from --hosts or --host-pattern. This
            process starts only its own worker.

Options:
  --mode MODE            local | slurm | hostfile | env (required).
  --num-workers N        local: number of processes (default: one per GPU with --per-gpu).
  --per-gpu              one process per GPU instead of one per host; sets
                         CUDA_VISIBLE_DEVICES to the worker's GPU, chosen on its host: the
                         LOCAL_RANK-th entry of the CUDA_VISIBLE_DEVICES the host already has
                         (never a GPU outside it; slurm/env: a one-GPU list is the task's
                         GPU), else LOCAL_RANK. More workers on a host than its listed (or
                         nvidia-smi's) GPUs is an error. Hostfile mode decides on each remote
                         host: this host's CUDA_VISIBLE_DEVICES is not used there.
  --gpus-per-host N      hostfile + --per-gpu: processes per host (default 8).
  --port PORT            first port; a host's workers use PORT, PORT+1, ... (default: free
                         ports in local mode, 9991 otherwise). All hosts must agree.
  --port-per-rank        rank R uses PORT+R on whatever host it runs (default: a host's
                         workers count from PORT): for host names that are one machine
                         (several Slurm nodes or hostfile lines on one host).
  --job-name NAME        DTENSOR_JOB_NAME (default worker).
  --device auto|cpu|gpu  gpu sets DTENSOR_GPU_USE_NCCL_COMMUNICATION=1, cpu sets 0; auto
                         (default) sets 1 on each worker's host where nvidia-smi lists a GPU,
                         decided on that host: here in local mode, by each srun task or pod
                         under slurm/env, by the remote shell in hostfile mode (this host's
                         GPUs never count). --per-gpu implies gpu. A value already set in
                         DTENSOR_GPU_USE_NCCL_COMMUNICATION here (with auto: also on a
                         remote host) is kept and passed on.
  --hostfile FILE        hostfile mode: the hosts.
  --ssh COMMAND          hostfile mode: the remote shell (default "ssh -o BatchMode=yes"),
                         run as COMMAND -- HOST REMOTE_SCRIPT (a host starting with '-' is
                         refused).
  --export NAMES         hostfile mode: comma list of variables passed to remote workers
                         (default PATH,PYTHONPATH,VIRTUAL_ENV,KERAS_BACKEND,
                         TF_CPP_MIN_LOG_LEVEL,XLA_FLAGS,DTENSOR_GPU_USE_NCCL_COMMUNICATION,
                         CUDA_CACHE_PATH,CUDA_CACHE_MAXSIZE plus every TFLLM_* and NCCL_*).
                         TFLLM_CHECKPOINT_KEY, when set, always reaches every worker and never
                         a command line (which ps shows): hostfile mode sends it on the
                         remote shell's stdin; the other modes' workers inherit it.
  --rank R               env mode: this process's rank (overrides the environment).
  --world-size N         env mode: the number of processes.
  --hosts H0,H1,...      env mode: one host per rank, or one per node when the world size is
                         a multiple (ranks fill a node's slots in order).
  --host-pattern PAT     env mode: hosts from a pattern, {{rank}} replaced by 0..N-1, e.g.
                         'tfllm-{{rank}}.tfllm' (Indexed Job pods behind a headless Service).
  --log-dir DIR          where rank_N.log, ready.N and pids go (default WORKDIR/logs when the
                         command has --workdir WORKDIR, else ./multiworker-logs).
  --kill-timeout S       seconds between SIGTERM and SIGKILL when stopping (default 15).
  --startup-timeout S    fail if no worker is ready within S seconds (default 900; 0: never).
                         A worker is ready when it creates its TFLLM_READY_FILE (tfllm does
                         once its multi-client mesh is built, which needs every client, so
                         one ready worker means that all have joined).
  --ready-pattern REGEX  for commands other than tfllm: a worker is also ready when an
                         output line matches this (Python) regular expression.
  --max-restarts N       local and hostfile modes: after a failure or startup timeout, stop
                         everything and start all workers again, up to N times (default 0).
                         `tfllm train --workdir` resumes from the latest checkpoint there.
                         Never after a worker exits 2 (bad input) or 74 (failed storage).
                         Under slurm and env the scheduler restarts the whole job.
  --dry-run              print each worker's environment, what its host runs first
                         (hostfile: "on HOST: ...") and its command; start nothing.
  --expand-nodelist LIST print a SLURM nodelist's hostnames, one per line, and exit
                         (scontrol show hostnames, else a built-in expansion).
  -h, --help             this help.

Exit codes:
  0     every worker exited 0
  2     bad arguments or environment (nothing was started; hostfile: a remote host
        whose GPUs do not fit --per-gpu stops its workers with 2 and one line)
  124   no worker became ready within --startup-timeout
  75    the workers were stopped by a forwarded signal and at least one exited 75
        (tfllm's "preempted, checkpoint saved, requeue me" code)
  74    a worker's storage failed (tfllm: disk full, quota, permissions); not restarted
  128+N the launcher itself got signal N (SIGINT 130, SIGTERM 143); it forwarded SIGTERM
  76    also: hostfile mode, ssh to a worker's host lost its connection (ssh exited 255)
  other the first failing worker's exit code (128+N when a signal N killed it)
  slurm: a rank stopped because another rank failed (it got Slurm's signal, or lost its
        peer: 76) exits 0 once that rank's own code is recorded in LOG_DIR/exit.RANK,
        so that srun --kill-on-bad-exit, which returns the highest code, returns it.

Signals: SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to every worker's process
group as SIGTERM, then SIGKILL after --kill-timeout. Not under --mode slurm: Slurm signals
every process of the step itself (scancel, --signal, time limit, preemption), and a second
SIGTERM would make tfllm stop without saving; the launcher waits for its worker instead.
"""

#: the options that take a value, and the flags, that the launcher parser accepts
VALUED_OPTIONS = ("--mode", "--num-workers", "--gpus-per-host", "--port", "--job-name",
                  "--device", "--hostfile", "--ssh", "--export", "--rank", "--world-size",
                  "--hosts", "--host-pattern", "--log-dir", "--kill-timeout",
                  "--startup-timeout", "--ready-pattern", "--max-restarts",
                  "--expand-nodelist")
FLAG_OPTIONS = ("--per-gpu", "--dry-run", "--port-per-rank")


@dataclass
class Options:
    """The launcher's options (see USAGE); values as given, validated by `validate`."""

    values: dict = field(default_factory=dict)
    flags: set = field(default_factory=set)
    command: List[str] = field(default_factory=list)
    help: bool = False

    def get(self, name: str, default=None):
        return self.values.get(name, default)


def parse(argv: List[str]) -> Options:
    """Options before '--', the command after it; --opt=value equals --opt value."""
    opts = Options()
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("--") and "=" in arg:
            arg, value = arg.split("=", 1)
            args.insert(0, value)
        if arg in ("-h", "--help"):
            opts.help = True
            return opts
        if arg in FLAG_OPTIONS:
            opts.flags.add(arg)
        elif arg == "--":
            opts.command = args
            break
        elif arg in VALUED_OPTIONS:
            if not args:
                raise LaunchError(f"{arg} needs a value")
            opts.values[arg] = args.pop(0)
            if arg == "--expand-nodelist":
                return opts
        else:
            raise LaunchError(f"unknown argument '{arg}'; options come before '--', the "
                              "command after it")
    return opts


def _whole(opts: Options, name: str, default: int, minimum: int = 0) -> int:
    value = opts.get(name, str(default))
    if not value.isdigit():
        raise LaunchError(f"{name} must be a whole number of seconds/times, got '{value}'")
    if int(value) < minimum:
        raise LaunchError(f"{name} must be at least {minimum}")
    return int(value)


def expand_nodelist(nodelist: str) -> List[str]:
    """scontrol's expansion when scontrol exists (SCONTROL overrides its path), else ours."""
    scontrol = os.environ.get("SCONTROL", "scontrol")
    if shutil.which(scontrol):
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True).stdout
        return out.split()
    return topo.expand_nodelist(nodelist)


@functools.lru_cache(maxsize=None)
def _gpu_count() -> int:
    """This host's GPUs, asked at most once per launch; only in modes that run here."""
    return dev.nvidia_smi_gpu_count()


@dataclass
class Plan:
    """Everything decided before a process starts."""

    topology: topo.Topology
    device: str
    per_gpu: bool
    job_name: str
    port: Optional[int]
    log_dir: str
    kill_timeout: int
    startup_timeout: int
    max_restarts: int
    ready_pattern: Optional[re.Pattern]
    command: List[str]
    ssh: List[str]
    exports: Optional[str]
    port_per_rank: bool = False


def make_plan(opts: Options, environ) -> Plan:
    """Validates the options against the environment; raises LaunchError naming the fix."""
    mode = opts.get("--mode")
    if mode is None:
        raise LaunchError("--mode is required: local, slurm, hostfile or env")
    if mode not in ("local", "slurm", "hostfile", "env"):
        raise LaunchError(f"--mode '{mode}' is unknown; use local, slurm, hostfile or env")
    command = opts.command
    if not command:
        raise LaunchError(f"no command after '--'; e.g. --mode {mode} ... -- tfllm train "
                          "--config configs/tiny.yaml --workdir runs/x")
    kill_timeout = _whole(opts, "--kill-timeout", 15)
    startup_timeout = _whole(opts, "--startup-timeout", 900)
    max_restarts = _whole(opts, "--max-restarts", 0)
    gpus_per_host = _whole(opts, "--gpus-per-host", 8, minimum=1)
    port = opts.get("--port")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise LaunchError(f"--port must be a TCP port number (1-65535), got '{port}'")
    device = opts.get("--device", "auto")
    if device not in dev.DEVICES:
        raise LaunchError(f"--device '{device}' is unknown; use auto, cpu or gpu")
    per_gpu = "--per-gpu" in opts.flags
    if device == "auto" and per_gpu:
        device = "gpu"
    # Otherwise auto stays auto: `topology.worker_specs` resolves it on each worker's host.
    pattern = opts.get("--ready-pattern")
    try:
        ready_pattern = re.compile(pattern) if pattern else None
    except re.error as e:
        raise LaunchError(f"--ready-pattern '{pattern}' is not a valid regular expression "
                          f"({e})") from None
    if mode == "local":
        workers = opts.get("--num-workers")
        if workers is None:
            # --per-gpu: one worker per GPU this host lets us use (an empty list: none).
            visible = environ.get("CUDA_VISIBLE_DEVICES")
            count = 0
            if per_gpu and visible is not None:
                count = len(visible.split(",")) if visible else 0
            elif per_gpu:
                count = _gpu_count()
            if not count:
                raise LaunchError("--num-workers is required in local mode (no GPUs found "
                                  "to count with --per-gpu)")
            workers = str(count)
        if not workers.isdigit():
            raise LaunchError(f"--num-workers must be at least 1, got '{workers}'")
        topology = topo.local_topology(int(workers))
    elif mode == "slurm":
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        nodes = (expand_nodelist(nodelist) if nodelist and environ.get("SLURM_PROCID")
                 and environ.get("SLURM_NTASKS") else None)
        topology = topo.slurm_topology(environ, nodes)
    elif mode == "hostfile":
        path = opts.get("--hostfile")
        if not path:
            raise LaunchError("--mode hostfile needs --hostfile FILE (one host per line)")
        if not os.access(path, os.R_OK):
            raise LaunchError(f"--hostfile '{path}' does not exist or is not readable")
        with open(path) as f:
            hosts = topo.parse_hostfile(f.read(), path)
        topology = topo.hostfile_topology(hosts, gpus_per_host if per_gpu else 1)
        topo.secret_input(environ)  # a secret that cannot be sent: refused before any start
    else:
        topology = topo.env_topology(environ, opts.get("--rank"), opts.get("--world-size"),
                                     opts.get("--hosts"), opts.get("--host-pattern"))
    if max_restarts and mode in ("slurm", "env"):
        # One rank per launcher: restarting it alone would face the other ranks' dead or
        # waiting mesh. The scheduler restarts the whole job instead.
        raise LaunchError(f"--max-restarts restarts only this launcher's own rank under "
                          f"--mode {mode}, which would rejoin a dead mesh alone; let the "
                          "scheduler restart every rank together (SLURM: srun "
                          "--kill-on-bad-exit=1 in an sbatch --requeue job; Kubernetes: a "
                          "JobSet with failurePolicy.maxRestarts) and drop --max-restarts")
    workdir = topo.command_workdir(command)
    log_dir = (os.path.expanduser(opts.get("--log-dir")) if opts.get("--log-dir")
               else RunPaths(workdir).logs_dir if workdir else "multiworker-logs")
    return Plan(topology, device, per_gpu, opts.get("--job-name", "worker"),
                int(port) if port else None, log_dir, kill_timeout, startup_timeout,
                max_restarts, ready_pattern, list(command),
                shlex.split(opts.get("--ssh", "ssh -o BatchMode=yes")), opts.get("--export"),
                "--port-per-rank" in opts.flags)


class Ports:
    """The DTensor ports of one attempt; picked free ones stay reserved until `release`.

    Picking a free port by binding it and closing the socket leaves a race: another
    process may take the port before the worker's TensorFlow binds it. So a free port
    here stays bound by the launcher, with SO_REUSEPORT and on the wildcard address of
    both IP versions, while the attempt runs. A bound socket that does not listen gets no
    connections; the workers get TF_GRPC_REUSE_PORT=1, which makes TensorFlow's gRPC
    server set SO_REUSEPORT too, and only sockets of the same user that set it may share
    the port. The kernel's choice of a port for port 0 never shares one with an existing
    binding, so no stale server is on it.

    Args:
      numbers: the port of each rank.
      held: the sockets that reserve them (empty for ports the user chose).
    """

    def __init__(self, numbers: List[int], held: Optional[List[socket.socket]] = None):
        self.numbers = numbers
        self.held = held or []

    def release(self) -> None:
        for s in self.held:
            s.close()
        self.held = []


def _reserve_port() -> socket.socket:
    """A socket bound with SO_REUSEPORT to a free port on every local address."""
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
        address = ("::", 0)
    except OSError:  # a host without IPv6
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = ("", 0)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(address)
    except BaseException:
        s.close()
        raise
    return s


def reserve_free_ports(count: int) -> Ports:
    """`count` distinct free TCP ports here, held until `Ports.release` (see `Ports`)."""
    held = []
    try:
        for _ in range(count):
            held.append(_reserve_port())
    except OSError as e:
        Ports([], held).release()
        raise LaunchError(f"cannot reserve {count} free TCP ports here ({e}); give "
                          "--port") from None
    return Ports([s.getsockname()[1] for s in held], held)


def check_port_free(port: int, local_mode: bool) -> None:
    """Raises LaunchError when a program listens on `port` here (on any address).

    SO_REUSEADDR, as TensorFlow's gRPC server binds: connections of an ended job that
    linger in TIME_WAIT do not make the port busy (they did: "port 19995 is in use" for
    a Slurm job started right after a cancelled one).
    """
    if not port_free(port):
        raise LaunchError(f"port {port} is in use on {socket.gethostname()}; choose "
                          "another --port" + (" or omit it to pick free ports"
                                              if local_mode else ""))


def assign_ports(plan: Plan) -> Ports:
    t = plan.topology
    if t.mode == "local" and plan.port is None:
        return reserve_free_ports(t.world_size)
    ports = topo.fixed_ports(t, plan.port, plan.port_per_rank)
    if t.mode != "hostfile":  # hostfile ports are on other hosts
        for rank in t.own_ranks:
            check_port_free(ports[rank], t.mode == "local")
    return Ports(ports)


def plan_specs(plan: Plan, attempt: int, ports: Ports, environ) -> List[topo.WorkerSpec]:
    """The specs of this launcher's workers for one attempt (new ready keys each time).

    Args:
      ports: the attempt's ports; reserved ones give each worker TF_GRPC_REUSE_PORT=1.
      environ: the launcher's environment (CUDA_VISIBLE_DEVICES, an explicit
        DTENSOR_GPU_USE_NCCL_COMMUNICATION); this host's GPUs are counted only in the
        modes whose workers run here.
    """
    t = plan.topology
    logs = LaunchLogs(os.path.abspath(plan.log_dir))
    ready = {r: logs.ready(r) for r in t.own_ranks}
    keys = {r: secrets.token_hex(8) for r in t.own_ranks} if t.mode == "hostfile" else None
    specs = topo.worker_specs(t, ports.numbers, plan.job_name, plan.device, plan.per_gpu,
                              attempt, environ.get("CUDA_VISIBLE_DEVICES"), ready, keys,
                              environ, _gpu_count)
    if ports.held:  # the worker's gRPC server shares the port the launcher holds
        for spec in specs:
            spec.env[REUSE_PORT_ENV] = "1"
    return specs


def worker_argv(plan: Plan, spec: topo.WorkerSpec, environ) -> List[str]:
    """What to execute for `spec`: the command, or in hostfile mode ssh with the script."""
    if plan.topology.mode != "hostfile":
        return list(plan.command)
    names = topo.exported_names(environ, plan.exports)
    exports = {n: environ[n] for n in names if n in environ}
    # The ready file is on this host: a remote worker prints its TFLLM_READY_KEY instead.
    env = {k: v for k, v in spec.env.items() if k != "TFLLM_READY_FILE"}
    script = topo.remote_script(dataclasses.replace(spec, env=env), plan.command,
                                os.getcwd(), exports, topo.secret_input(environ)[0])
    # `--`: the host is never read as an option of ssh (parse_hostfile refuses a leading
    # '-' as well; this covers --ssh wrappers that pass their arguments on)
    return plan.ssh + ["--", spec.host, script]


def worker_input(plan: Plan, environ) -> bytes:
    """What a worker's remote shell reads first (hostfile mode): the secrets
    (TFLLM_CHECKPOINT_KEY), one line each, never on a command line. Nothing in the other
    modes, whose workers inherit them from this environment (or the scheduler's)."""
    if plan.topology.mode != "hostfile":
        return b""
    return topo.secret_input(environ)[1].encode()


def main(argv: Optional[List[str]] = None, prog: str = "tfllm launch") -> int:
    argv = sys.argv[1:] if argv is None else argv

    def say(message: str) -> None:
        print(f"{prog}: {message}", file=sys.stderr, flush=True)

    def fail(message: str) -> int:
        print(f"{prog}: error: {message} (see {prog} --help)",  # one line, as tfllm's
              file=sys.stderr, flush=True)
        return BAD_INPUT_EXIT_CODE  # bad arguments or environment: nothing was started

    try:
        opts = parse(argv)
        if opts.help:
            print(USAGE.format(prog=prog), end="")
            return 0
        if "--expand-nodelist" in opts.values:
            print("\n".join(expand_nodelist(opts.values["--expand-nodelist"])))
            return 0
        plan = make_plan(opts, os.environ)
        # Here too, before anything starts: a port in use, GPUs that do not fit --per-gpu.
        ports = assign_ports(plan)
    except LaunchError as e:
        return fail(str(e))
    try:
        return _launch(plan, opts, ports, say, fail)
    finally:
        ports.release()


def _launch(plan: Plan, opts: Options, ports: Ports, say, fail) -> int:
    """Everything after the options are valid: --dry-run, or start and supervise."""
    try:
        first_specs = plan_specs(plan, 0, ports, os.environ)
    except LaunchError as e:
        return fail(str(e))
    t = plan.topology

    if "--dry-run" in opts.flags:
        print(f"mode={t.mode} world_size={t.world_size} device={plan.device} "
              f"log_dir={plan.log_dir}")
        for spec in first_specs:
            print(f"rank {spec.rank} host {spec.host} port {spec.port}")
            for k, v in spec.env.items():
                print(f"  {k}={v}")
            for line in spec.host_setup:
                print(f"  on {spec.host}: {line}")
            if worker_input(plan, os.environ):
                print(f"  stdin: {', '.join(topo.secret_input(os.environ)[0])} (not shown)")
            print("  exec: " + " ".join(shlex.quote(w) for w in worker_argv(plan, spec,
                                                                            os.environ)))
        return 0
    try:
        files.make_dirs(plan.log_dir)
    except OSError:
        return fail(f"cannot create the log directory '{plan.log_dir}'; give a writable "
                    "--log-dir")
    log_dir = os.path.abspath(plan.log_dir)
    # Slurm signals every process of a step itself: a forwarded second SIGTERM would make
    # tfllm stop without saving.
    supervisor = sup.Supervisor(log_dir, plan.kill_timeout, plan.startup_timeout,
                                plan.ready_pattern, say, forward_signals=t.mode != "slurm")
    supervisor.install_signal_handlers()

    def start_all(attempt: int) -> None:
        specs = first_specs
        if attempt:  # new free ports (local mode): the old ones may linger in TIME_WAIT
            held = assign_ports(plan)
            ports.release()
            ports.numbers, ports.held = held.numbers, held.held
            specs = plan_specs(plan, attempt, ports, os.environ)
        for spec in specs:
            supervisor.start(spec, worker_argv(plan, spec, os.environ), attempt,
                             remote=t.mode == "hostfile",
                             stdin_data=worker_input(plan, os.environ))
        say(f"attempt {attempt}: started rank(s) {' '.join(map(str, t.own_ranks))} of "
            f"{t.world_size}; logs in {log_dir}")

    try:
        code = sup.run_job(supervisor, start_all, plan.max_restarts, say)
        if t.mode == "slurm":  # srun -K returns the highest code: let the cause's win
            code = scheduler.exit_code(log_dir, t.own_ranks[0], t.world_size, code,
                                       bool(supervisor.signal_received), os.environ, say)
            scheduler.hold_late_signals()  # srun's kill of the others must not change it
        return code
    except (LaunchError, files.Refused) as e:  # a port taken; a link planted in the logs
        supervisor.stop_all()
        return fail(str(e))
    finally:
        supervisor.kill_all()


if __name__ == "__main__":
    sys.exit(main())
