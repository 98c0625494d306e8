"""Multi-client DTensor on localhost: 2 real processes x 4 logical CPU devices."""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 240


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _train_cmd(workdir, axes):
    return [sys.executable, "-m", "tfllm.cli.main", "train", "--config", "configs/tiny.yaml",
            "--workdir", str(workdir), "--set", f"mesh.axes={axes}", "--set", "train.steps=4",
            "--set", "train.log_every=1", "--set", "data.source=synthetic"]


def _losses(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return np.array([json.loads(l)["loss"] for l in lines])


def _run_all(cmds_envs):
    """Starts every command in its own process group; kills them all on any failure."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for cmd, env in cmds_envs]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("axes", ["data=8", "data=2,model=4"])
def test_two_clients_match_one_client(tmp_path, axes):
    base = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    _run_all([(_train_cmd(tmp_path / "single", axes), base)])
    ports = _free_ports(2)
    jobs = ",".join(f"localhost:{p}" for p in ports)
    envs = [dict(base, DTENSOR_JOBS=jobs, DTENSOR_JOB_NAME="worker", DTENSOR_CLIENT_ID=str(i))
            for i in range(2)]
    outputs = _run_all([(_train_cmd(tmp_path / f"client{i}", axes), env)
                        for i, env in enumerate(envs)])
    assert f"mesh [{axes.replace(',', ', ')}]" in outputs[0]
    # Only client 0 writes metrics and progress; client 1 logs to its own file.
    assert not (tmp_path / "client1" / "metrics.jsonl").exists()
    assert "mesh [" in (tmp_path / "client1" / "logs" / "client_1.log").read_text()
    single = _losses(tmp_path / "single")
    # Same mesh, same devices' shards, only split across processes: the collectives run
    # over the coordination service instead of in-process, summing in the same order up
    # to float32 rounding (see the tolerance reasoning in tests/train/test_parity.py).
    np.testing.assert_allclose(_losses(tmp_path / "client0"), single, rtol=1e-5)
    assert single[-1] < single[0]
