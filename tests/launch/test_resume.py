"""Inside tfllm under the launcher: restart-and-resume, and mismatched client configs."""

import json
import re
import signal
import subprocess

import pytest

from tests.harness import TF_HANG_S, signal_at_step
from tests.launch.helpers import (PY, ROOT, assert_no_leftovers, kill_group, kill_workers,
                                  launcher_env, start)

TIMEOUT_S = TF_HANG_S  # bounds a hang only (and --startup-timeout, which must not fire)


def _train_cmd(workdir, *extra):
    return [PY, "-m", "tfllm.cli.main", "train", "--config", "configs/tiny.yaml",
            "--workdir", str(workdir), "--set", "mesh.axes=data=2,model=4",
            "--set", "mesh.num_cpu_devices=4", "--set", "train.steps=40",
            "--set", "train.log_every=1", "--set", "data.source=synthetic",
            "--set", "checkpoint.every=5", "--set", "train.eval_steps=1", *extra]


def _steps(workdir):
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(l)["step"] for l in path.read_text().splitlines() if '"loss"' in l]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_resumes(tmp_path):
    workdir = tmp_path / "run"
    proc = start(["--mode", "local", "--num-workers", "2", "--kill-timeout", "5",
                  "--max-restarts", "1", "--startup-timeout", str(TIMEOUT_S), "--",
                  *_train_cmd(workdir)])
    # rank 1 dies at step 12 (a watcher process sends it: a stall of this process
    # cannot let the run reach step 40 first)
    watcher = signal_at_step(workdir / "metrics.jsonl", 12, signal.SIGKILL,
                             f"{workdir / 'logs' / 'pids'}:1")
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        kill_group(watcher)
        kill_group(proc)
        kill_workers(workdir / "logs")
    assert_no_leftovers(tmp_path)
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    assert "resuming after step" in out  # the restarted run continued from a checkpoint
    steps = _steps(workdir)
    assert steps[-1] == 40
    assert steps == sorted(set(steps))  # metrics.jsonl was cut back to the checkpoint


@pytest.mark.multiprocess
@pytest.mark.slow
def test_clients_with_different_configs_are_reported(tmp_path):
    import socket
    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("localhost", 0))
    jobs = ",".join(f"localhost:{s.getsockname()[1]}" for s in socks)
    for s in socks:
        s.close()
    procs = []
    try:
        for i in range(2):
            env = launcher_env(DTENSOR_JOBS=jobs, DTENSOR_JOB_NAME="worker",
                               DTENSOR_CLIENT_ID=str(i))
            cmd = _train_cmd(tmp_path / "run", "--set", f"train.steps={10 + i}")
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        out1 = procs[1].communicate(timeout=TIMEOUT_S)[0]
    finally:
        for p in procs:
            kill_group(p)
    assert procs[1].returncode == 2, out1[-3000:]
    assert "train.steps: client 0 has 10, client 1 has 11" in out1


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_signal_to_one_client_stops_every_client_at_the_same_step(tmp_path):
    # Only rank 1 gets SIGTERM (not through the launcher): the clients' vote at each step
    # boundary (one all-reduce over the mesh) makes both save the same step and exit 75.
    workdir = tmp_path / "run"
    proc = start(["--mode", "local", "--num-workers", "2", "--kill-timeout", "5",
                  "--startup-timeout", str(TIMEOUT_S), "--", *_train_cmd(workdir)])
    watcher = signal_at_step(workdir / "metrics.jsonl", 3, signal.SIGTERM,
                             f"{workdir / 'logs' / 'pids'}:1")
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        kill_group(watcher)
        kill_group(proc)
        kill_workers(workdir / "logs")
    assert_no_leftovers(tmp_path)
    assert proc.returncode == 75, (out[-3000:], err[-3000:])
    logs = [(workdir / "logs" / "rank_0.log").read_text(),
            (workdir / "logs" / "rank_1.log").read_text()]
    stopped = [re.findall(r"checkpoint of step (\d+) is saved", log) for log in logs]
    assert stopped[0] and stopped[0] == stopped[1], logs
