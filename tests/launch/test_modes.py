"""The modes end to end through launch/multiworker.sh (dry runs, stand-in workers, no TF);
the rules themselves are unit-tested in test_topology.py."""

import re

import pytest

import os

from tests.launch.helpers import (PY, assert_no_leftovers, fake_gpu_host, go_when_ready,
                                  kill_workers, launcher_env, run, run_until_ready)


def _dry_run(args, **env):
    code, out, err = run([*args, "--dry-run", "--", "tfllm", "train"],
                         env=launcher_env(**env))
    assert code == 0, err
    ranks = {}
    for block in re.split(r"^rank ", out, flags=re.M)[1:]:
        rank = int(block.split()[0])
        ranks[rank] = dict(re.findall(r"^  ([A-Z_]+)=(.*)$", block, re.M))
        ranks[rank]["on host"] = re.findall(r"^  on \S+: (.*)$", block, re.M)
    return ranks


def _gpu_path(tmp_path, gpus):
    """PATH with a fake nvidia-smi listing `gpus` GPUs first; and its calls file."""
    bin_dir, calls = fake_gpu_host(tmp_path, gpus)
    return f"{bin_dir}:{os.environ['PATH']}", calls


def test_expand_nodelist_without_scontrol():
    code, out, err = run(["--expand-nodelist", "node[01-02,07],login"])
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
    assert ranks[2]["DTENSOR_GPU_USE_NCCL_COMMUNICATION"] == "0"  # --device cpu: NCCL off


@pytest.mark.parametrize("mode_args, env", [
    (["--mode", "local", "--num-workers", "2"], {}),
    (["--mode", "slurm"], {"SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                           "SLURM_JOB_NODELIST": "n[1-2]"}),
    (["--mode", "env", "--rank", "0", "--world-size", "2", "--hosts", "a,b"], {}),
], ids=["local", "slurm", "env"])
@pytest.mark.parametrize("gpus", [0, 2])
def test_auto_counts_gpus_where_the_workers_run(tmp_path, mode_args, env, gpus):
    # local/slurm/env: the launcher runs on its workers' host (an srun task, a pod).
    path, calls = _gpu_path(tmp_path, gpus)
    ranks = _dry_run(mode_args, PATH=path, **env)
    for e in ranks.values():
        assert e["TFLLM_DEVICE"] == "auto"
        assert e.get("DTENSOR_GPU_USE_NCCL_COMMUNICATION") == ("1" if gpus else None)
    assert open(calls).read().split() == ["launcher"]  # asked once, whatever the ranks


@pytest.mark.parametrize("gpus", [0, 8])
def test_hostfile_auto_never_asks_the_launchers_host(tmp_path, gpus):
    path, calls = _gpu_path(tmp_path, gpus)
    hosts = tmp_path / "hosts"
    hosts.write_text("nodeA\nnodeB\n")
    ranks = _dry_run(["--mode", "hostfile", "--hostfile", str(hosts)], PATH=path)
    for e in ranks.values():
        # Neither a GPU login node nor one without GPUs decides for the workers: each
        # remote host runs the probe before the command.
        assert "DTENSOR_GPU_USE_NCCL_COMMUNICATION" not in e and e["TFLLM_DEVICE"] == "auto"
        assert len(e["on host"]) == 1 and "nvidia-smi -L" in e["on host"][0]
    assert not os.path.exists(calls)


def test_local_per_gpu_counts_the_visible_gpus(tmp_path):
    path, _ = _gpu_path(tmp_path, 8)
    ranks = _dry_run(["--mode", "local", "--per-gpu"], PATH=path, CUDA_VISIBLE_DEVICES="3,5")
    assert [ranks[r]["CUDA_VISIBLE_DEVICES"] for r in sorted(ranks)] == ["3", "5"]
    assert all(e["DTENSOR_GPU_USE_NCCL_COMMUNICATION"] == "1" for e in ranks.values())


def test_the_users_nccl_setting_is_kept(tmp_path):
    path, calls = _gpu_path(tmp_path, 8)
    ranks = _dry_run(["--mode", "local", "--num-workers", "1", "--device", "gpu"], PATH=path,
                     DTENSOR_GPU_USE_NCCL_COMMUNICATION="0")
    assert ranks[0]["DTENSOR_GPU_USE_NCCL_COMMUNICATION"] == "0"
    assert not os.path.exists(calls)


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
                      "--gpus-per-host", "2"], CUDA_VISIBLE_DEVICES="6,7")
    assert sorted(ranks) == [0, 1, 2, 3]
    assert ranks[3]["DTENSOR_JOBS"] == "nodeA:9991,nodeA:9992,nodeB:9991,nodeB:9992"
    # Each remote host picks its GPU (from its own CUDA_VISIBLE_DEVICES, else the slot);
    # this host's "6,7" is not theirs.
    for rank, slot in enumerate([0, 1, 0, 1]):
        assert "CUDA_VISIBLE_DEVICES" not in ranks[rank]
        assert ranks[rank]["DTENSOR_GPU_USE_NCCL_COMMUNICATION"] == "1"  # --per-gpu: gpu
        (setup,) = ranks[rank]["on host"]
        assert f"shift {slot}; g=$1;" in setup and "6,7" not in setup


FAKE_SSH = """#!/bin/bash
# A stand-in for ssh: records the host, runs the remote script here, in the host's own
# environment when the test wrote one (env.HOST, e.g. its CUDA_VISIBLE_DEVICES). The
# launcher ends ssh's options with `--` before the host: required here.
[ "$1" = "--" ] || { echo "fake ssh: no -- before the host: $*" >&2; exit 99; }
shift
echo "$1" >> "$(dirname "$0")/ssh_hosts"
if [ -f "$(dirname "$0")/env.$1" ]; then set -a; . "$(dirname "$0")/env.$1"; set +a; fi
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
                             env=launcher_env(FORWARDED="yes"), cwd=str(tmp_path))
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
def test_hostfile_sends_the_checkpoint_key_on_stdin_only(tmp_path):
    """Every remote worker gets TFLLM_CHECKPOINT_KEY, which no command line holds (ps
    shows those to every user of both hosts)."""
    ssh = tmp_path / "fake_ssh"
    # as ssh: no environment passed on; its arguments recorded
    ssh.write_text(FAKE_SSH.replace('shift\n', 'shift\nunset TFLLM_CHECKPOINT_KEY\n'
                                    'printf "%s\\n" "$*" >> "$(dirname "$0")/ssh_args"\n'))
    ssh.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("hostA\nhostB\n")
    key = "s3cret key"
    args = ["--mode", "hostfile", "--hostfile", str(hosts), "--ssh", f"bash {ssh}",
            "--log-dir", str(tmp_path / "logs"), "--port", "20000"]
    worker = ("import os; print('key', os.environ['DTENSOR_CLIENT_ID'], "
              "repr(os.environ.get('TFLLM_CHECKPOINT_KEY')))")
    env = launcher_env(TFLLM_CHECKPOINT_KEY=key)
    code, out, err = run([*args, "--dry-run", "--", PY, "-c", worker], env=env,
                         cwd=str(tmp_path))
    assert code == 0 and key not in out and "stdin: TFLLM_CHECKPOINT_KEY (not shown)" in out
    try:
        code, out, err = run([*args, "--", PY, "-c", worker], env=env,
                             cwd=str(tmp_path))
        assert code == 0, err
        for rank in (0, 1):
            assert f"[rank {rank}] key {rank} {key!r}" in out
    finally:
        kill_workers(tmp_path / "logs")
    commands = (tmp_path / "ssh_args").read_text().splitlines()
    assert len(commands) == 2 and all(" sh -c " in c and key not in c for c in commands)
    assert_no_leftovers(tmp_path)


@pytest.mark.multiprocess
def test_local_mode_prefixes_and_logs(tmp_path):
    workdir = tmp_path / "run"
    try:
        code, out, err = run(["--mode", "local", "--num-workers", "3", "--", PY, "-c",
                              PRINT_ENV, "--workdir", str(workdir)])
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
    # The worker waits until the launcher said it is ready (`go`): an exit after a fixed
    # sleep raced the launcher's poll. --startup-timeout must not fire.
    worker = ("import os, time; assert 'TFLLM_READY_FILE' not in os.environ; "
              "time.sleep(1); print('tfllm: ready ' + os.environ['TFLLM_READY_KEY'], "
              "flush=True)" + go_when_ready(tmp_path / "go"))
    try:
        code, out, err = run_until_ready(["--mode", "hostfile", "--hostfile", str(hosts),
                                          "--ssh", f"bash {ssh}", "--log-dir", str(log_dir),
                                          "--port", "20000", "--startup-timeout", "60", "--",
                                          PY, "-c", worker], tmp_path / "go", cwd=str(tmp_path))
        assert code == 0, err
        assert "workers ready after" in err
    finally:
        kill_workers(log_dir)
    assert_no_leftovers(tmp_path)


GPU_ENV = ("import os; e = os.environ; print('on mesh [x]', e['DTENSOR_CLIENT_ID'], "
           "e.get('DTENSOR_GPU_USE_NCCL_COMMUNICATION'), e.get('CUDA_VISIBLE_DEVICES'))")


def _fake_cluster(tmp_path, host_envs):
    ssh = tmp_path / "fake_ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    for host, text in host_envs.items():
        (tmp_path / f"env.{host}").write_text(text)
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{h}\n" for h in host_envs))
    return ["--mode", "hostfile", "--hostfile", str(hosts), "--ssh", f"bash {ssh}",
            "--log-dir", str(tmp_path / "logs"), "--port", "20000"]


@pytest.mark.multiprocess
def test_hostfile_auto_probes_each_remote_host(tmp_path):
    """A GPU host gets NCCL and a CPU host does not, whatever the launcher's host has."""
    path, calls = _gpu_path(tmp_path, 2)  # the launcher's host: 2 GPUs, never asked
    args = _fake_cluster(tmp_path, {"gpuhost": "", "cpuhost": "FAKE_GPUS=0\n"})
    try:
        code, out, err = run([*args, "--", PY, "-c", GPU_ENV],
                             env=launcher_env(PATH=path), cwd=str(tmp_path))
        assert code == 0, err
        assert "[rank 0] on mesh [x] 0 1 None" in out, out
        assert "[rank 1] on mesh [x] 1 None None" in out, out
        assert sorted(open(calls).read().split()) == ["0", "1"]  # the workers', not ours
    finally:
        kill_workers(tmp_path / "logs")
    assert_no_leftovers(tmp_path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("host_envs, gpus", [
    ({"listed": "CUDA_VISIBLE_DEVICES=2,3\n", "unlisted": "unset CUDA_VISIBLE_DEVICES\n"},
     ["2", "3", "0", "1"]),
    ({"small": "CUDA_VISIBLE_DEVICES=4\n"}, None),  # one GPU for two workers
])
def test_hostfile_per_gpu_picks_within_each_hosts_list(tmp_path, host_envs, gpus):
    path, _ = _gpu_path(tmp_path, 2)
    args = _fake_cluster(tmp_path, host_envs)
    try:
        # The launcher's own list (6,7) belongs to this host and is used nowhere.
        code, out, err = run([*args, "--per-gpu", "--gpus-per-host", "2", "--", PY, "-c",
                              GPU_ENV], cwd=str(tmp_path),
                             env=launcher_env(PATH=path, CUDA_VISIBLE_DEVICES="6,7"))
        if gpus is None:
            assert code == 2, err  # the host's one-line error, passed on
            assert re.search(r"\[rank [01]\] --per-gpu: 2 workers per host "
                             r"\(--gpus-per-host\) but CUDA_VISIBLE_DEVICES=4 on \S+ lists "
                             r"1 GPU\(s\); lower --gpus-per-host", out), out
            assert "on mesh" not in out  # nothing started there
            return
        assert code == 0, err
        for rank, gpu in enumerate(gpus):
            assert f"[rank {rank}] on mesh [x] {rank} 1 {gpu}" in out, out
    finally:
        kill_workers(tmp_path / "logs")
    assert_no_leftovers(tmp_path)
