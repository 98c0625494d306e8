"""A peer that dies or hangs: the surviving client exits 76 with one line (real tfllm
clients, each under its own env-mode launcher, as on SLURM or Kubernetes; slow)."""

import os
import signal
import socket
import time

import pytest

from tfllm.checkpoint import committed
from tests.harness import TF_HANG_S
from tests.launch.helpers import (PY, assert_no_leftovers, finish, kill_group, kill_workers,
                                  start)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
TIMEOUT_S = TF_HANG_S  # bounds a hang only
#: the survivor's watchdog must fire on a silent peer, never on a live one whose heartbeat
#: thread (every 2 s) a loaded machine delays: 2 s x 3 (load) x 5
PEER_TIMEOUT_S = 30


def _launch(rank, ports, workdir, log_dir):
    hosts = "localhost,localhost"
    # env mode gives each rank its slot's port: one port per host slot from --port, so
    # both ranks use consecutive ports on localhost.
    return start(["--mode", "env", "--rank", str(rank), "--world-size", "2", "--hosts", hosts,
                  "--port", str(ports), "--log-dir", str(log_dir), "--kill-timeout", "5",
                  "--", PY, "-m", "tfllm.cli.main", "train", "--config", "configs/tiny.yaml",
                  "--workdir", str(workdir), "--set", "mesh.num_cpu_devices=4",
                  "--set", "mesh.axes=data=8", "--set", "data.source=synthetic",
                  "--set", "train.steps=100000", "--set", "checkpoint.every=10",
                  "--set", f"train.peer_timeout_s={PEER_TIMEOUT_S}"])


def _worker_pid(log_dir, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = log_dir / "pids"
        if path.exists() and path.read_text().strip():
            return int(path.read_text().split()[1])
        time.sleep(0.2)
    raise AssertionError("no worker pid")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_survivor_exits_76_naming_the_lost_peer(tmp_path, sig):
    with socket.socket() as s:  # two consecutive free ports
        s.bind(("", 0))
        port = s.getsockname()[1]
    workdir = tmp_path / "run"
    logs = [tmp_path / "logs0", tmp_path / "logs1"]
    procs = [_launch(0, port, workdir, logs[0]), _launch(1, port, workdir, logs[1])]
    try:
        # Both clients train (a checkpoint is committed), then rank 1's worker goes.
        deadline = time.monotonic() + TIMEOUT_S
        while not (workdir / "checkpoints").exists() or not committed(
                str(workdir / "checkpoints")):
            assert time.monotonic() < deadline, "the clients did not reach a checkpoint"
            assert all(p.poll() is None for p in procs), [finish(p, 5) for p in procs]
            time.sleep(0.5)
        os.kill(_worker_pid(logs[1]), sig)
        # PEER_TIMEOUT_S of silence, then at once; a survivor that waited on in its
        # collective would hang past the bound
        code, out, err = finish(procs[0], timeout=TIMEOUT_S)
        assert code == 76, (out[-3000:], err[-3000:])
        lines = [l for l in out.splitlines() if "stopped responding" in l]
        assert len(lines) == 1, out[-3000:]
        assert lines[0].startswith("[rank 0] tfllm train: error: client 1 stopped responding")
        assert "the latest committed checkpoint is step" in lines[0]
        assert "Traceback" not in out
        assert "rank 0 exited with code 76" in err
    finally:
        for p in procs:
            kill_group(p)
        for log_dir in logs:
            kill_workers(log_dir)
    assert_no_leftovers(tmp_path)
