"""A real Slurm (munge, slurmctld, two slurmd "nodes") and a real sshd on this machine.

For the tests that run `sbatch launch/slurm.sbatch`, `srun ... --mode slurm` and hostfile
mode over ssh against the real daemons (tests/launch/test_real_slurm.py, test_real_ssh.py).
Each daemon runs in the foreground as our child, on ports picked free here and with its
state in one temporary directory, so that it can be stopped by pid and leave nothing: a
munged, Slurm or sshd that the machine runs already is never touched (its own socket,
ports and pid files are separate). Installing needs root and the Debian archive
(`apt-get install --no-install-recommends ...`); elsewhere the caller skips with the
reason `unavailable` gives.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import List, Optional

from tests.harness import PY

SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
SSH_PACKAGES = ("openssh-server",)
#: a real cluster tool's directory goes before the session's fakes (tests/conftest.py)
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
#: the slurm.conf Slurm (22.05) needs for two nodes on one host. KillWait is Slurm's
#: grace between SIGTERM and SIGKILL at scancel: long enough for a tiny run to save.
#: MinJobAge=4 and batch_sched_delay=0 make `sbatch --wait` return in ~2 s, not ~10 s.
SLURM_CONF = """\
ClusterName=tfllmtest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
AuthInfo=socket={dir}/munge/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/slurmd-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=4
SchedulerParameters=batch_sched_delay=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _run(cmd, timeout=60, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install(packages) -> Optional[str]:
    """Installs `packages` with apt when missing; the reason they cannot be, else None."""
    binaries = {"slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd",
                "slurm-client": "/usr/bin/sbatch", "munge": "/usr/sbin/munged",
                "openssh-server": "/usr/sbin/sshd"}
    if all(os.path.exists(binaries[p]) for p in packages):
        return None
    if os.geteuid() != 0:
        return f"not root: cannot install {' '.join(packages)} (apt-get needs root)"
    if not shutil.which("apt-get"):
        return "no apt-get on this machine (the real-cluster tests install Debian packages)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # A lock timeout: the Slurm and the ssh fixtures may install at once (pytest-xdist).
    lock = ["-o", "DPkg::Lock::Timeout=300"]
    try:
        for cmd in (["apt-get", *lock, "update", "-qq"],
                    ["apt-get", *lock, "install", "-y", "-qq", "--no-install-recommends",
                     *packages]):
            result = _run(cmd, timeout=600, env=env)
            if result.returncode:
                return f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr[-300:]}"
    except subprocess.TimeoutExpired:
        return "apt-get took more than 600 s"
    return None


class Daemons:
    """Foreground daemons started by us; `stop` ends each by pid, SIGKILL after 15 s."""

    def __init__(self):
        self.procs: List[subprocess.Popen] = []

    def start(self, cmd, log_path, **kw) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        self.procs = []


HOSTS = "/etc/hosts"
#: what the fixture appends to /etc/hosts (and removes) when it has no two names to use
HOSTS_LINE = "127.0.0.1 tfllm-node1 tfllm-node2  # tests/launch/real_cluster.py\n"


def loopback_names(path=HOSTS) -> List[str]:
    """Names /etc/hosts gives a 127.x address, except `localhost` (Slurm reads
    NodeName=localhost as "this host's own name", which the other node has already)."""
    names = []
    with open(path) as f:
        for line in f:
            words = line.split("#")[0].split()
            if words and words[0].startswith("127."):
                names += [w for w in words[1:] if w != "localhost" and w not in names]
    return names


class SlurmCluster:
    """munged, slurmctld and two slurmd nodes of one host, named by two names of this host.

    Attributes:
      dir: the state directory (slurm.conf, logs, spool), removed by `stop`.
      nodes: the two node names (each resolves to this host, so DTensor reaches them).
      env: the environment for sbatch/srun/scancel: SLURM_CONF, and PATH with the real
        tools before the session's fakes and this Python's bin directory first.
    """

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="tfllm-slurm-")
        self.daemons = Daemons()
        self.host = socket.gethostname().split(".")[0]
        self.nodes = loopback_names()[:2]
        self.added_hosts_line = None
        self.env = None

    def start(self) -> None:
        d = self.dir
        os.chmod(d, 0o755)  # munged runs as the munge user and opens its socket in here
        for sub in ("state", "spool", "log", "munge"):
            os.makedirs(os.path.join(d, sub))
        shutil.chown(os.path.join(d, "munge"), "munge", "munge")
        if len(self.nodes) < 2:  # two node names that DTensor's clients can resolve
            with open(HOSTS, "a") as f:
                f.write(HOSTS_LINE)
            self.added_hosts_line = HOSTS_LINE
            self.nodes = ["tfllm-node1", "tfllm-node2"]
        ports = [free_port() for _ in range(3)]
        nodes = "\n".join(
            f"NodeName={name} NodeAddr=127.0.0.1 Port={port} "
            "CPUs=1 State=UNKNOWN" for name, port in zip(self.nodes, ports[1:]))
        conf = os.path.join(d, "slurm.conf")
        with open(conf, "w") as f:
            f.write(SLURM_CONF.format(host=self.host, ctld_port=ports[0], dir=d, nodes=nodes))
        self.env = dict(os.environ, SLURM_CONF=conf,
                        PATH=os.path.dirname(PY) + os.pathsep + SYSTEM_PATH)
        for k in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[k]
        m = os.path.join(d, "munge")
        self.daemons.start(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "-F",
                            f"--socket={m}/munge.socket", f"--pid-file={m}/munged.pid",
                            f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                           os.path.join(d, "log", "munged.out"))
        self._wait(lambda: os.path.exists(f"{m}/munge.socket"), "munged's socket")
        self.daemons.start(["/usr/sbin/slurmctld", "-D", "-f", conf],
                           os.path.join(d, "log", "slurmctld.out"), env=self.env)
        for name in self.nodes:
            self.daemons.start(["/usr/sbin/slurmd", "-D", "-f", conf, "-N", name],
                               os.path.join(d, "log", f"slurmd-{name}.out"), env=self.env)

        def idle():
            out = _run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env).stdout
            return out.split() == ["idle", "idle"]

        self._wait(idle, "two idle nodes in sinfo")

    def _wait(self, ready, what, timeout=300.0) -> None:  # bounds a hang: slurmd start-up
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.daemons.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join(open(os.path.join(self.dir, "log", n)).read()[-800:]
                               for n in sorted(os.listdir(os.path.join(self.dir, "log"))))
                raise RuntimeError(f"real Slurm: no {what} (exited: {dead}); logs:\n{logs}")
            time.sleep(0.2)

    def squeue(self) -> List[str]:
        return _run(["squeue", "-h", "-o", "%i"], env=self.env).stdout.split()

    def wait_idle(self, timeout=300.0) -> bool:
        """True once no job is left in squeue (a finished job lingers MinJobAge s);
        `timeout` bounds a hang only: it returns as soon as squeue is empty."""
        deadline = time.monotonic() + timeout
        while self.squeue() and time.monotonic() < deadline:
            time.sleep(0.3)
        return not self.squeue()

    def stop(self) -> None:
        """Cancels every job, stops the daemons by pid, removes the state directory."""
        try:
            if self.env is not None and self.daemons.procs:
                jobs = self.squeue()
                if jobs:
                    _run(["scancel", "--signal=KILL", "--full", *jobs], env=self.env)
                    _run(["scancel", *jobs], env=self.env)
                    self.wait_idle(timeout=40)
        finally:
            self.daemons.stop()
            shutil.rmtree(self.dir, ignore_errors=True)
            if self.added_hosts_line:
                with open(HOSTS) as f:
                    lines = f.readlines()
                with open(HOSTS, "w") as f:
                    f.writelines(l for l in lines if l != self.added_hosts_line)


SSHD_CONFIG = """\
Port {port}
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
HostKey {dir}/hostkey
PidFile {dir}/sshd.pid
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
"""


class Sshd:
    """A foreground sshd on 127.0.0.1 and 127.0.0.2 (two "hosts") with a throwaway host key and client key.

    Attributes:
      port: its port.
      ssh: the client command line (`--ssh` of hostfile mode) with the client key.
    """

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="tfllm-sshd-")
        self.daemons = Daemons()
        self.port = free_port()
        self.ssh = ""

    def start(self) -> None:
        d = self.dir
        for key in ("hostkey", "clientkey"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/{key}"])
        shutil.copy(f"{d}/clientkey.pub", f"{d}/authorized_keys")
        os.chmod(f"{d}/authorized_keys", 0o600)
        os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory
        with open(f"{d}/sshd_config", "w") as f:
            f.write(SSHD_CONFIG.format(port=self.port, dir=d))
        check = _run(["/usr/sbin/sshd", "-t", "-f", f"{d}/sshd_config"])
        if check.returncode:
            raise RuntimeError(f"sshd -t: {check.stderr}")
        self.daemons.start(["/usr/sbin/sshd", "-D", "-e", "-f", f"{d}/sshd_config"],
                           f"{d}/sshd.log")
        self.ssh = (f"/usr/bin/ssh -p {self.port} -i {d}/clientkey -o BatchMode=yes "
                    "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                    "-o LogLevel=ERROR")
        deadline = time.monotonic() + 120  # bounds a hang: sshd's start-up
        while _run([*self.ssh.split(), "127.0.0.1", "true"]).returncode:
            if time.monotonic() > deadline or self.daemons.procs[0].poll() is not None:
                raise RuntimeError("sshd did not answer: " + open(f"{d}/sshd.log").read())
            time.sleep(0.2)

    def stop(self) -> None:
        self.daemons.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
