"""The modes end to end through launch/multiworker.sh (dry runs, stand-in workers, no TF);
the rules themselves are unit-tested in test_topology.py."""

import re

import pytest

from tests.launch.helpers import PY, assert_no_leftovers, kill_workers, launcher_env, run


def _dry_run(args, **env):
    code, out, err = run([*args, "--dry-run", "--", "tfllm", "train"], timeout=30,
                         env=launcher_env(**env))
    assert code == 0, err
    ranks = {}
    for block in re.split(r"^rank ", out, flags=re.M)[1:]:
        rank = int(block.split()[0])
        ranks[rank] = dict(re.findall(r"^  ([A-Z_]+)=(.*)$", block, re.M))
    return ranks


def test_expand_nodelist_without_scontrol():
    code, out, err = run(["--expand-nodelist", "node[01-02,07],login"], timeout=30)
    assert code == 0, err
    assert out.split() == ["node01", "node02", "node07", "login"]


def test_slurm_per_gpu_block_distribution():
    env = {"SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "CUDA_VISIBLE_DEVICES": "4,5"}
    for rank, (gpu, port) in enumerate([("4", "9991"), ("5", "9992")] * 2):
        ranks = _dry_run(["--mode", "slurm", "--per-gpu"], SLURM_PROCID=str(rank), **env)
        assert list(ranks) == [rank]  # each srun task starts only its own worker
        e = ranks[rank]
        assert e["DTENSOR_JOBS"] == "n1:9991,n1:9992,n2:9991,n2:9992"
        assert e["DTENSOR_CLIENT_ID"] == str(rank)
        # The GPU is picked from what SLURM made visible, by the task's slot on its node.
        assert e["CUDA_VISIBLE_DEVICES"] == gpu
        assert e["DTENSOR_GPU_USE_NCCL_COMMUNICATION"] == "1"


def test_slurm_one_task_per_node_uses_job_nodelist():
    ranks = _dry_run(["--mode", "slurm", "--device", "cpu", "--port", "4000"],
                     SLURM_PROCID="2", SLURM_NTASKS="3", SLURM_JOB_NODELIST="c[7-9]")
    assert ranks[2]["DTENSOR_JOBS"] == "c7:4000,c8:4000,c9:4000"
    assert "CUDA_VISIBLE_DEVICES" not in ranks[2]
    assert "DTENSOR_GPU_USE_NCCL_COMMUNICATION" not in ranks[2]


@pytest.mark.parametrize("args, env, rank, jobs", [
    (["--host-pattern", "tfllm-{rank}.tfllm", "--world-size", "3"],
     {"JOB_COMPLETION_INDEX": "1"}, 1, "tfllm-0.tfllm:9991,tfllm-1.tfllm:9991,tfllm-2.tfllm:9991"),
    (["--hosts", "h0,h1"], {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, 3,
     "h0:9991,h0:9992,h1:9991,h1:9992"),
    (["--hosts", "a,b", "--rank", "0", "--world-size", "2", "--job-name", "trainer"],
     {"JOB_COMPLETION_INDEX": "1"}, 0, "a:9991,b:9991"),  # --rank wins
])
def test_env_mode(args, env, rank, jobs):
    ranks = _dry_run(["--mode", "env", "--device", "cpu", *args], **env)
    assert list(ranks) == [rank]
    assert ranks[rank]["DTENSOR_JOBS"] == jobs
    assert ranks[rank]["DTENSOR_CLIENT_ID"] == str(rank)
    assert ranks[rank]["DTENSOR_JOB_NAME"] == ("trainer" if "--job-name" in args else "worker")


def test_hostfile_per_gpu_dry_run(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nnodeA\n\nnodeB slots=2  # trailing comment\n")
    ranks = _dry_run(["--mode", "hostfile", "--hostfile", str(hosts), "--per-gpu",
                      "--gpus-per-host", "2"])
    assert sorted(ranks) == [0, 1, 2, 3]
    assert ranks[3]["DTENSOR_JOBS"] == "nodeA:9991,nodeA:9992,nodeB:9991,nodeB:9992"
    assert [ranks[r]["CUDA_VISIBLE_DEVICES"] for r in range(4)] == ["0", "1", "0", "1"]


FAKE_SSH = """#!/bin/bash
# A stand-in for ssh: records the host, runs the remote script here.
echo "$1" >> "$(dirname "$0")/ssh_hosts"
exec bash -c "$2"
"""

PRINT_ENV = ("import os; e = os.environ; print('on mesh [x]', e['DTENSOR_CLIENT_ID'], "
             "e['DTENSOR_JOBS'], e['MULTIWORKER_WORLD_SIZE'], e.get('FORWARDED'), os.getcwd())")


@pytest.mark.multiprocess
def test_hostfile_over_fake_ssh(tmp_path):
    ssh = tmp_path / "fake_ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("hostA\nhostB\n")
    log_dir = tmp_path / "logs"
    try:
        code, out, err = run(["--mode", "hostfile", "--hostfile", str(hosts), "--ssh",
                              f"bash {ssh}", "--log-dir", str(log_dir), "--port",
                              "20000", "--export", "FORWARDED", "--", PY, "-c", PRINT_ENV],
                             timeout=60, env=launcher_env(FORWARDED="yes"), cwd=str(tmp_path))
        assert code == 0, err
        assert sorted((tmp_path / "ssh_hosts").read_text().split()) == ["hostA", "hostB"]
        for rank in (0, 1):
            line = f"on mesh [x] {rank} hostA:20000,hostB:20000 2 yes {tmp_path}"
            assert f"[rank {rank}] {line}" in out
            assert line in (log_dir / f"rank_{rank}.log").read_text()
    finally:
        kill_workers(log_dir)
    assert_no_leftovers(tmp_path)


@pytest.mark.multiprocess
def test_local_mode_prefixes_and_logs(tmp_path):
    workdir = tmp_path / "run"
    try:
        code, out, err = run(["--mode", "local", "--num-workers", "3", "--", PY, "-c",
                              PRINT_ENV, "--workdir", str(workdir)], timeout=60)
        assert code == 0, err
        jobs = re.search(r"\[rank 0\] on mesh \[x\] 0 (\S+)", out).group(1).split(",")
        assert len(jobs) == 3 and len(set(jobs)) == 3 and all(j.startswith("localhost:") for j in jobs)
        # Default log dir: the command's --workdir/logs.
        for rank in range(3):
            assert f"[rank {rank}] on mesh [x] {rank} " in out
            assert (workdir / "logs" / f"rank_{rank}.log").exists()
        assert "workers ready" in err or "all workers exited 0" in err
    finally:
        kill_workers(workdir / "logs")
    assert_no_leftovers(tmp_path)


@pytest.mark.multiprocess
def test_hostfile_readiness_by_key(tmp_path):
    """Remote workers cannot create the launcher's ready file: they print their key."""
    ssh = tmp_path / "fake_ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("hostA\n")
    log_dir = tmp_path / "logs"
    worker = ("import os, time; assert 'TFLLM_READY_FILE' not in os.environ; "
              "time.sleep(1); print('tfllm: ready ' + os.environ['TFLLM_READY_KEY'], "
              "flush=True); time.sleep(2)")
    try:
        code, out, err = run(["--mode", "hostfile", "--hostfile", str(hosts), "--ssh",
                              f"bash {ssh}", "--log-dir", str(log_dir), "--port", "20000",
                              "--startup-timeout", "30", "--", PY, "-c", worker],
                             timeout=60, cwd=str(tmp_path))
        assert code == 0, err
        assert "workers ready after" in err
    finally:
        kill_workers(log_dir)
    assert_no_leftovers(tmp_path)
