"""Hostfile mode against a real sshd (tests/launch/conftest.py): two "hosts", 127.0.0.1
and 127.0.0.2, each worker started over ssh. The 2-worker run gives one process's losses
(the reference of test_real_slurm: the same settings), the checkpoint key reaches the
workers on ssh's stdin only, and a dropped connection ends the run with the peer-loss code
and leaves no process on either side.
"""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.harness import TF_HANG_S, metrics_records
from tests.launch.helpers import (PY, TRAIN, free_port_pair, launcher_env, reference_losses,
                                  start, wait_for_step)



@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of test_real_slurm's reference: the same settings, one process."""
    return reference_losses(tmp_path_factory)


TIMEOUT_S = TF_HANG_S  # bounds a hang only (and --startup-timeout, which must not fire)
SECRET = "tfllm-test-key-" + "5" * 24

# per test: the fixture's apt-get (up to 2 x 600 s) and the runs' hang bounds fit
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(1800)]


def _launch(sshd, tmp_path, workdir, *extra_train):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n127.0.0.2\n")
    # PATH is passed on to the remote shells: this checkout's `tfllm` first
    env = launcher_env(TFLLM_CHECKPOINT_KEY=SECRET,
                       PATH=os.path.dirname(PY) + os.pathsep + os.environ["PATH"])
    return start(["--mode", "hostfile", "--hostfile", str(hostfile), "--ssh", sshd.ssh,
                  "--device", "cpu", "--port", str(free_port_pair()), "--port-per-rank",
                  "--kill-timeout", "5", "--startup-timeout", str(TIMEOUT_S), "--",
                  "tfllm", "train", "--config", "configs/tiny.yaml", "--workdir",
                  str(workdir), "--set", "mesh.axes=data=2", "--set",
                  "mesh.num_cpu_devices=1", *TRAIN, *extra_train], env=env)


def _command_lines():
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return out.splitlines()


def _session_pids():
    """sshd's per-connection processes (the listener is `sshd -D`)."""
    out = subprocess.run(["pgrep", "-f", "^sshd: "], capture_output=True, text=True).stdout
    return set(out.split())


def _wait_gone(marker, before, wait_s=60.0):  # bounds a hang: returns once all are gone
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        left = [l for l in _command_lines() if str(marker) in l and "pgrep" not in l]
        sessions = _session_pids() - before
        if not left and not sessions:
            return
        time.sleep(0.3)
    raise AssertionError(f"left running: {left} sessions {sessions}")


def _remote_workers(workdir):
    """{rank: (pid, environment)} of the workers started by the remote shells."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        ids = [e for e in environ if e.startswith(b"DTENSOR_CLIENT_ID=")]
        if str(workdir).encode() in cmdline and b"tfllm" in cmdline and ids:
            found[int(ids[0].split(b"=")[1])] = (pid, environ)
    return found


def _sshd_session_of(workdir, rank):
    """The sshd process serving the worker of `rank` (its remote side's ancestor)."""
    pid = _remote_workers(workdir).get(rank, ("1",))[0]
    while pid != "1":
        pid = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]
        if open(f"/proc/{pid}/comm").read().startswith("sshd"):
            return int(pid)
    raise AssertionError(f"no sshd session serves rank {rank}")


def test_hostfile_over_real_ssh_trains_like_one_process(real_sshd, reference, tmp_path):
    workdir = tmp_path / "run"
    before = _session_pids()
    proc = _launch(real_sshd, tmp_path, workdir)
    seen, keys = [], {}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            seen += [l for l in _command_lines() if SECRET in l]  # ps, on both "hosts"
            for rank, (_, environ) in _remote_workers(workdir).items():
                keys[rank] = f"TFLLM_CHECKPOINT_KEY={SECRET}".encode() in environ
            time.sleep(0.5)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    assert not seen, seen  # the key is never on a command line
    assert keys == {0: True, 1: True}, keys  # but in both remote workers' environment
    assert "[rank 1] tfllm: client 1/2 ready on mesh [data=2]" in out
    # and client 0 signed the checkpoint with it
    (ckpt,) = (workdir / "checkpoints").iterdir()
    assert "manifest_hmac_sha256" in json.loads((ckpt / "COMMIT").read_text())
    np.testing.assert_allclose(np.array([r["loss"] for r in metrics_records(workdir)
                                         if "loss" in r]), reference, rtol=1e-6)
    _wait_gone(tmp_path, before)


def test_a_dropped_connection_ends_the_run_as_a_lost_peer(real_sshd, tmp_path):
    workdir = tmp_path / "run"
    before = _session_pids()
    proc = _launch(real_sshd, tmp_path, workdir, "--set", "train.steps=5000")
    try:
        wait_for_step(proc, workdir, 3, TIMEOUT_S)
        # Drop rank 1's connection on the server side: SIGKILL its sshd session process.
        os.kill(_sshd_session_of(workdir, rank=1), signal.SIGKILL)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # The dropped session races two documented endings: rank 0 sees its peer gone (76,
    # a lost peer), or rank 1's worker takes the session's SIGHUP as a stop signal first
    # and the clients stop together at the next step with a checkpoint (75). Idle, the
    # second wins; under load, the first (measured: 7 of 7 runs alone gave 75, the suite
    # under -n 2 usually 76). Either way the run ends, and nothing is left running.
    assert proc.returncode in (75, 76), (out[-3000:], err[-3000:])
    if proc.returncode == 75:
        assert "is saved" in out + err, (out[-3000:], err[-3000:])
        assert any((workdir / "checkpoints").glob("step_*")), "75 without a checkpoint"
    _wait_gone(tmp_path, before)
