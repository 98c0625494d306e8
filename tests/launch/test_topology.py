"""Who runs where, as pure functions: no processes, no TF (tfllm.launch.topology)."""

import io

import pytest

from tfllm.launch import topology as topo
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
    specs = topo.worker_specs(t, topo.fixed_ports(t, None), per_gpu=True,
                              visible_gpus="6,7")  # hostfile: remote GPUs, not ours
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1", "0", "1"]
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
    topo.announce_ready({"TFLLM_READY_FILE": str(path), "TFLLM_READY_KEY": "abc",
                         "DTENSOR_CLIENT_ID": "1"}, out)
    assert path.read_text() == "1"
    assert out.getvalue() == "tfllm: ready abc\n"
    topo.announce_ready({}, out)  # outside a launcher: nothing
    assert out.getvalue() == "tfllm: ready abc\n"


def test_remote_script_quotes_and_watches_stdin():
    spec = topo.WorkerSpec(0, "h", 1, {"DTENSOR_CLIENT_ID": "0"})
    script = topo.remote_script(spec, ["tfllm", "train", "--set", "a=it's"], "/work dir",
                                {"PATH": "/bin"})
    assert script.startswith("cd '/work dir' || exit 2; exec 3<&0; env PATH=/bin "
                             "DTENSOR_CLIENT_ID=0 tfllm train --set 'a=it'\"'\"'s'")
    assert "read -r _ <&3; kill -TERM $p" in script  # the watcher of a dropped connection


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
