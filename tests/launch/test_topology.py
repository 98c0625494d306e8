"""Who runs where, as pure functions: no processes, no TF (tfllm.launch.topology)."""

import io
import os
import re
import shlex
import subprocess

import pytest

from tfllm.runtime import coordination
from tfllm.launch import topology as topo
from tfllm.launch.device import NCCL_ENV as NCCL, NCCL_PROBE_SH
from tfllm.launch.main import make_plan, parse
from tfllm.launch.topology import LaunchError


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a1,b[8-10]", ["a1", "b8", "b9", "b10"]),
    ("gpu-[1-2]-x[1-2],login", ["gpu-1-x1", "gpu-1-x2", "gpu-2-x1", "gpu-2-x2", "login"]),
    ("single", ["single"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert topo.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[3-1]", "n[a-b]"])
def test_bad_nodelist_range(bad):
    with pytest.raises(LaunchError, match="cannot expand nodelist range"):
        topo.expand_nodelist(bad)


def test_tasks_per_node():
    assert topo.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(LaunchError, match="expected e.g. '8\\(x4\\)'"):
        topo.expand_tasks_per_node("2x3")


def _never():
    raise AssertionError("counted GPUs on the launcher's host")


SLURM = {"SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
         "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def test_slurm_block_distribution_and_gpus():
    for rank, gpu in enumerate(["4", "5", "4", "5"]):
        t = topo.slurm_topology(dict(SLURM, SLURM_PROCID=str(rank)))
        assert t.hosts == ["n1", "n1", "n2", "n2"] and t.own_ranks == [rank]
        (spec,) = topo.worker_specs(t, topo.fixed_ports(t, None), device="gpu", per_gpu=True,
                                    visible_gpus="4,5")
        assert spec.env["DTENSOR_JOBS"] == "n1:9991,n1:9992,n2:9991,n2:9992"
        assert spec.env["DTENSOR_CLIENT_ID"] == str(rank)
        # The GPU is picked from what SLURM made visible, by the task's slot on its node.
        assert spec.env["CUDA_VISIBLE_DEVICES"] == gpu
        assert spec.env["DTENSOR_GPU_USE_NCCL_COMMUNICATION"] == "1"


def test_slurm_job_nodelist_one_task_per_node():
    t = topo.slurm_topology({"SLURM_PROCID": "2", "SLURM_NTASKS": "3",
                             "SLURM_JOB_NODELIST": "c[7-9]"})
    (spec,) = topo.worker_specs(t, topo.fixed_ports(t, 4000))
    assert spec.env["DTENSOR_JOBS"] == "c7:4000,c8:4000,c9:4000"
    assert "CUDA_VISIBLE_DEVICES" not in spec.env
    # The default gpu_count (0) is a host without GPUs: auto leaves NCCL unset.
    assert spec.env["TFLLM_DEVICE"] == "auto" and NCCL not in spec.env


@pytest.mark.parametrize("env, message", [
    ({}, "SLURM_PROCID is not set"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "neither SLURM_STEP_NODELIST"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n[1-2]",
      "SLURM_TASKS_PER_NODE": "1(x2)"}, "add up to 2, not SLURM_NTASKS=3"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-3]",
      "SLURM_TASKS_PER_NODE": "1(x2)"}, "3 nodes"),
])
def test_slurm_errors(env, message):
    with pytest.raises(LaunchError, match=message):
        topo.slurm_topology(env)


def test_hostfile():
    hosts = topo.parse_hostfile("# two nodes\nnodeA\n\nnodeB slots=2  # trailing\n")
    assert hosts == ["nodeA", "nodeB"]
    t = topo.hostfile_topology(hosts, slots_per_host=2)
    assert t.own_ranks == [0, 1, 2, 3] and t.local_ranks == [0, 1, 0, 1]
    specs = topo.worker_specs(t, topo.fixed_ports(t, None), device="gpu", per_gpu=True,
                              visible_gpus="6,7", gpu_count=_never)
    # The launcher's "6,7" says nothing about nodeA and nodeB: each remote host picks its
    # GPU from its own list (or its slot) before the command, for 2 workers per host.
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in specs)
    assert [s.host_setup for s in specs] == [[topo.pick_gpu_sh(slot, 2)]
                                             for slot in (0, 1, 0, 1)]
    with pytest.raises(LaunchError, match="lists no hosts"):
        topo.parse_hostfile("# nothing\n\n", "hosts.txt")


@pytest.mark.parametrize("kwargs, env, rank, hosts", [
    (dict(host_pattern="tfllm-{rank}.tfllm", world_size="3"), {"JOB_COMPLETION_INDEX": "1"},
     1, ["tfllm-0.tfllm", "tfllm-1.tfllm", "tfllm-2.tfllm"]),
    (dict(hosts="h0,h1"), {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, 3,
     ["h0", "h0", "h1", "h1"]),
    (dict(hosts="a,b", rank="0", world_size="2"), {"JOB_COMPLETION_INDEX": "1"}, 0,
     ["a", "b"]),  # --rank wins over the environment
])
def test_env_mode(kwargs, env, rank, hosts):
    t = topo.env_topology(env, **kwargs)
    assert t.hosts == hosts and t.own_ranks == [rank]


@pytest.mark.parametrize("kwargs, env, message", [
    (dict(world_size="2", hosts="a,b"), {}, "no rank"),
    (dict(hosts="a,b"), {"JOB_COMPLETION_INDEX": "1"}, "no world size"),
    (dict(rank="2", world_size="2", hosts="a,b"), {}, "--rank must be in 0..1"),
    (dict(rank="0", world_size="2"), {}, "needs the hosts"),
    (dict(rank="0", world_size="4", hosts="a,b,c"), {}, "--hosts has 3 entries"),
    (dict(rank="0", world_size="2", hosts="a,b", host_pattern="x{rank}"), {}, "not both"),
])
def test_env_mode_errors(kwargs, env, message):
    with pytest.raises(LaunchError, match=message):
        topo.env_topology(env, **kwargs)


def test_ports_by_slot_and_limits():
    t = topo.local_topology(3)
    assert topo.fixed_ports(t, 20000) == [20000, 20001, 20002]
    with pytest.raises(LaunchError, match="exceeds 65535"):
        topo.fixed_ports(t, 65534)
    with pytest.raises(LaunchError, match="at least 1"):
        topo.local_topology(0)


def test_worker_environment_and_handshake():
    t = topo.local_topology(2)
    specs = topo.worker_specs(t, [5, 6], job_name="trainer", attempt=3,
                              ready_files={0: "/r/ready.0", 1: "/r/ready.1"},
                              ready_keys={1: "k1"})
    assert [s.env["MULTIWORKER_LOCAL_RANK"] for s in specs] == ["0", "1"]
    assert specs[1].env["DTENSOR_JOBS"] == "localhost:5,localhost:6"
    assert specs[1].env["MULTIWORKER_ATTEMPT"] == "3"
    assert specs[1].env["DTENSOR_JOB_NAME"] == "trainer"
    assert specs[0].env["TFLLM_READY_FILE"] == "/r/ready.0"
    assert "TFLLM_READY_KEY" not in specs[0].env and specs[1].env["TFLLM_READY_KEY"] == "k1"


def test_announce_ready_creates_the_file_and_prints_the_key(tmp_path):
    out = io.StringIO()
    path = tmp_path / "ready.1"
    coordination.announce_ready({"TFLLM_READY_FILE": str(path), "TFLLM_READY_KEY": "abc",
                                 "DTENSOR_CLIENT_ID": "1"}, out)
    assert path.read_text() == "1"
    assert out.getvalue() == "tfllm: ready abc\n"
    coordination.announce_ready({}, out)  # outside a launcher: nothing
    assert out.getvalue() == "tfllm: ready abc\n"


def test_remote_script_quotes_and_watches_stdin():
    spec = topo.WorkerSpec(0, "h", 1, {"DTENSOR_CLIENT_ID": "0"}, ["echo setup"])
    command = topo.remote_script(spec, ["tfllm", "train", "--set", "a=it's"], "/work dir",
                                 {"PATH": "/bin"})
    # POSIX sh whatever the login shell (zsh does not split words, csh is not sh).
    shell, flag, script = shlex.split(command)
    assert (shell, flag) == ("sh", "-c")
    # Exported first, so that the host's setup sees the worker's whole environment.
    assert script.startswith("cd '/work dir' || exit 2; export PATH=/bin DTENSOR_CLIENT_ID=0; "
                             "echo setup; exec 3<&0; tfllm train --set 'a=it'\"'\"'s'")
    assert "read -r _ <&3; kill -TERM $p" in script  # the watcher of a dropped connection


def test_secrets_go_on_stdin_never_on_the_command_line():
    environ = {"TFLLM_CHECKPOINT_KEY": " s3cret 'key ", "TFLLM_X": "1"}
    assert "TFLLM_CHECKPOINT_KEY" not in topo.exported_names(environ, None)
    assert topo.exported_names(environ, "TFLLM_CHECKPOINT_KEY,A") == ["A"]  # not even so
    names, text = topo.secret_input(environ)
    assert names == ["TFLLM_CHECKPOINT_KEY"] and text == " s3cret 'key \n"
    assert topo.secret_input({"TFLLM_CHECKPOINT_KEY": ""}) == ([], "")
    spec = topo.WorkerSpec(0, "h", 1, {"DTENSOR_CLIENT_ID": "0"}, [])
    worker = ["python3", "-c", "import os; print(repr(os.environ['TFLLM_CHECKPOINT_KEY']))"]
    command = topo.remote_script(spec, worker, "/", {"TFLLM_X": "1"}, names)
    assert "s3cret" not in command
    # The remote shell reads it whole (spaces, quotes) and the worker gets it; the rest of
    # stdin (ssh's, held open by the launcher) is still watched for a dropped connection.
    env = {k: v for k, v in os.environ.items() if k != "TFLLM_CHECKPOINT_KEY"}
    proc = subprocess.Popen(shlex.split(command), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    proc.stdin.write(text)
    proc.stdin.flush()  # and kept open, as the launcher does (EOF stops the worker)
    out = proc.stdout.read()
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0 and out  # bounds a hang: a bare python3 -c == repr(environ["TFLLM_CHECKPOINT_KEY"]) + "\n"


def test_a_secret_with_a_line_break_is_refused():
    with pytest.raises(LaunchError, match="TFLLM_CHECKPOINT_KEY holds a line break"):
        topo.secret_input({"TFLLM_CHECKPOINT_KEY": "a\nb"})


def test_exported_names_and_workdir():
    names = topo.exported_names({"TFLLM_X": "1", "NCCL_DEBUG": "INFO", "HOME": "/h"}, None)
    assert "PATH" in names and "TFLLM_X" in names and "NCCL_DEBUG" in names
    assert "HOME" not in names
    assert topo.exported_names({}, "A,B") == ["A", "B"]
    assert topo.command_workdir(["tfllm", "train", "--workdir", "runs/x"]) == "runs/x"
    assert topo.command_workdir(["tfllm", "train", "--workdir=runs/y"]) == "runs/y"
    assert topo.command_workdir(["true"]) is None


def test_options_parse_like_the_shell_script():
    opts = parse(["--mode=local", "--num-workers", "2", "--per-gpu", "--", "cmd", "--mode",
                  "x"])
    assert opts.values == {"--mode": "local", "--num-workers": "2"}
    assert opts.flags == {"--per-gpu"} and opts.command == ["cmd", "--mode", "x"]
    with pytest.raises(LaunchError, match="--port needs a value"):
        parse(["--port"])
    with pytest.raises(LaunchError, match="unknown argument '--bogus'"):
        parse(["--bogus"])


def test_plan_defaults():
    plan = make_plan(parse(["--mode", "local", "--num-workers", "2", "--device", "cpu", "--",
                            "tfllm", "train", "--workdir", "runs/x"]), {})
    assert plan.log_dir == "runs/x/logs" and plan.kill_timeout == 15
    assert plan.startup_timeout == 900 and plan.max_restarts == 0
    assert plan.ready_pattern is None  # readiness is the handshake unless asked


@pytest.mark.parametrize("mode_args", [["--mode", "env", "--rank", "0", "--world-size", "2",
                                        "--hosts", "a,b"]])
def test_no_lone_restarts_in_per_rank_modes(mode_args):
    # One rank per launcher: a restart would rejoin a dead mesh alone.
    with pytest.raises(LaunchError, match="restart every rank together"):
        make_plan(parse([*mode_args, "--max-restarts", "1", "--", "tfllm", "train"]), {})
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}
    with pytest.raises(LaunchError, match="--mode slurm, which would rejoin a dead mesh"):
        make_plan(parse(["--mode", "slurm", "--max-restarts", "2", "--", "true"]), slurm)


# ---- NCCL and GPUs, decided on each worker's host ------------------------------------------
def _gpus(count):
    return lambda: count


def _hostfile_topology(slots=1):
    return topo.hostfile_topology(["nodeA", "nodeB"], slots)


def _slurm_rank(rank, tasks_per_node=2):
    return topo.slurm_topology({"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(2 * tasks_per_node),
                                "SLURM_STEP_NODELIST": "n[1-2]",
                                "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x2)"})


@pytest.mark.parametrize("topology", [topo.local_topology(2), _slurm_rank(1),
                                      topo.env_topology({}, "1", "2", "a,b")],
                         ids=["local", "slurm", "env"])
@pytest.mark.parametrize("gpus, nccl", [(2, "1"), (0, None)])
def test_auto_nccl_where_the_launcher_runs_on_the_workers_host(topology, gpus, nccl):
    # local/slurm/env: this launcher runs on its workers' host, so its nvidia-smi counts.
    for spec in topo.worker_specs(topology, [1, 2, 3, 4], device="auto", gpu_count=_gpus(gpus)):
        assert spec.env["TFLLM_DEVICE"] == "auto"
        assert spec.env.get(NCCL) == nccl and spec.host_setup == []


def test_hostfile_auto_is_decided_on_each_remote_host():
    # A GPU login node (or one without GPUs) says nothing about the workers: never counted.
    specs = topo.worker_specs(_hostfile_topology(), [1, 2], device="auto", gpu_count=_never)
    for spec in specs:
        assert NCCL not in spec.env and spec.env["TFLLM_DEVICE"] == "auto"
        assert spec.host_setup == [NCCL_PROBE_SH]


@pytest.mark.parametrize("topology", [topo.local_topology(2), _hostfile_topology()],
                         ids=["local", "hostfile"])
@pytest.mark.parametrize("device, nccl", [("gpu", "1"), ("cpu", "0")])
def test_explicit_device_needs_no_probe(topology, device, nccl):
    for spec in topo.worker_specs(topology, [1, 2], device=device, gpu_count=_never):
        assert spec.env[NCCL] == nccl and spec.env["TFLLM_DEVICE"] == device
        assert spec.host_setup == []


@pytest.mark.parametrize("topology", [topo.local_topology(1), _hostfile_topology()],
                         ids=["local", "hostfile"])
@pytest.mark.parametrize("device", ["auto", "gpu"])
def test_the_users_nccl_setting_wins_and_travels(topology, device):
    specs = topo.worker_specs(topology, [1, 2], device=device, environ={NCCL: "0"},
                              gpu_count=_never)
    assert all(s.env[NCCL] == "0" and s.host_setup == [] for s in specs)


@pytest.mark.parametrize("workers, visible, gpus, expected", [
    (2, "3,5", 8, ["3", "5"]),  # the inherited list, not nvidia-smi's first GPUs
    (2, None, 8, ["0", "1"]),
    (2, None, 0, ["0", "1"]),   # no nvidia-smi here (a dry run on a laptop): by slot
    (3, "3,5", 8, "CUDA_VISIBLE_DEVICES='3,5' lists 2 GPU(s); start at most 2 per host "
                  "(--num-workers)"),
    (2, "5", 8, "lists 1 GPU(s)"),  # local: one GPU for two workers is not a binding
    (2, "", 8, "lists 0 GPU(s)"),   # an empty list hides every GPU
    (3, None, 2, "nvidia-smi lists 2 GPU(s) here; start at most 2 per host (--num-workers)"),
])
def test_local_per_gpu_stays_within_the_visible_gpus(workers, visible, gpus, expected):
    t = topo.local_topology(workers)
    if isinstance(expected, str):
        with pytest.raises(LaunchError, match=re.escape(expected)):
            topo.worker_specs(t, list(range(workers)), per_gpu=True, visible_gpus=visible,
                              gpu_count=_gpus(gpus))
        return
    specs = topo.worker_specs(t, list(range(workers)), per_gpu=True, visible_gpus=visible,
                              gpu_count=_gpus(gpus))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == expected


@pytest.mark.parametrize("visible, tasks_per_node, expected", [
    ("4,5", 2, ["4", "5", "4", "5"]),
    ("7", 2, ["7", "7", "7", "7"]),   # srun --gpus-per-task=1: each task's own GPU
    ("4,5", 3, "--per-gpu: 3 workers per host but CUDA_VISIBLE_DEVICES='4,5' lists 2 GPU(s); "
               "start at most 2 per host (srun --ntasks-per-node)"),
])
def test_slurm_per_gpu_stays_within_the_visible_gpus(visible, tasks_per_node, expected):
    for rank in range(2 * tasks_per_node):
        t = _slurm_rank(rank, tasks_per_node)
        if isinstance(expected, str):
            # Every task of the node fails alike, not only those past the list's end.
            with pytest.raises(LaunchError, match=re.escape(expected)):
                topo.worker_specs(t, topo.fixed_ports(t, None), "worker", "gpu", True,
                                  visible_gpus=visible, gpu_count=_gpus(8))
            continue
        (spec,) = topo.worker_specs(t, topo.fixed_ports(t, None), "worker", "gpu", True,
                                    visible_gpus=visible, gpu_count=_gpus(8))
        assert spec.env["CUDA_VISIBLE_DEVICES"] == expected[rank]


def test_env_mode_per_gpu_names_its_options():
    t = topo.env_topology({}, "3", "4", "h0")  # four ranks on one pod
    with pytest.raises(LaunchError, match=re.escape("(--hosts/--world-size)")):
        topo.worker_specs(t, topo.fixed_ports(t, None), per_gpu=True, visible_gpus="0,1")


def test_the_launcher_expands_the_home_folder_of_its_folders(monkeypatch, tmp_path):
    # `--workdir=~/r` reaches tfllm unexpanded: the clients' logs went to a folder named ~
    monkeypatch.setenv("HOME", str(tmp_path))
    assert topo.command_workdir(["tfllm", "train", "--workdir=~/r"]) == str(tmp_path / "r")
    plan = make_plan(parse(["--mode=local", "--num-workers", "1", "--log-dir=~/logs", "--",
                            "true"]), {})
    assert plan.log_dir == str(tmp_path / "logs")
    plan = make_plan(parse(["--mode=local", "--num-workers", "1", "--", "tfllm", "train",
                            "--workdir=~/r"]), {})
    assert plan.log_dir == str(tmp_path / "r" / "logs")
