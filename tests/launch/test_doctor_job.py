"""The doctor for many nodes (tfllm.doctor.job): each rank writes its node's findings,
rank 0 prints one report for the job: versions, GPUs, ports and NCCL settings compared
across nodes, missing ranks named, every rank's ports reached from client 0 (real
processes on localhost), and the all-reduce bandwidth test's code run on CPUs."""

import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tfllm.doctor import allreduce, job as doctor
from tests.harness import (PY, TF_HANG_S, finish, free_ports, start_process, tfllm_command,
                           tfllm_env)
from tests.launch.helpers import assert_no_leftovers, run as run_launcher


def _report(rank, host, **changes):
    report = {"host": host, "rank": rank, "tensorflow": "2.21.0", "cuda": "12.5.1",
              "cudnn": "9", "nccl": "2.21.5", "driver": "560.35.03",
              "gpus": ["NVIDIA H100 80GB HBM3 (sm_90)"] * 8, "tf_gpus": 8,
              "nccl_env": {"NCCL_SOCKET_IFNAME": "eth0"}, "ports": {"9991": True},
              "ptxas": "/usr/local/cuda/bin/ptxas", "findings": [["ok", "8 GPUs"]]}
    report.update(changes)
    return report


def _levels(findings):
    return [(f.level, f.message) for f in findings if f.level != "ok"]


def test_nodes_that_agree_give_one_ok_report():
    found = doctor.compare({0: _report(0, "n0"), 1: _report(1, "n1")}, 2, 60)
    assert _levels(found) == []
    assert any("2 of 2 nodes reported: TensorFlow 2.21.0, CUDA 12.5.1" in f.message
               for f in found)
    assert any("NCCL_SOCKET_IFNAME=eth0" in f.message for f in found)


def test_what_differs_between_nodes_is_named_with_its_nodes():
    found = _levels(doctor.compare({
        0: _report(0, "n0"), 1: _report(1, "n1", nccl="2.18.3", gpus=["NVIDIA A100"] * 8,
                                        ports={"9991": False}, nccl_env={},
                                        findings=[["error", "libcudnn.so.9: not found"]]),
        2: _report(2, "n2")}, 4, 30))
    text = "\n".join(f"{level}: {m}" for level, m in found)
    assert "error: n1 (rank 1): libcudnn.so.9: not found" in text
    assert "error: the NCCL versions differ between nodes: 2.21.5 on n0 (rank 0), n2 " \
           "(rank 2); 2.18.3 on n1 (rank 1)" in text
    assert "error: the GPUs differ between nodes: 8 x NVIDIA H100 80GB HBM3 (sm_90) on n0 " \
           "(rank 0), n2 (rank 2); 8 x NVIDIA A100 on n1 (rank 1)" in text
    assert "error: n1 (rank 1): port 9991 is in use" in text
    assert "warning: the NCCL settings differ between nodes" in text
    assert "error: ranks 3 of 4 wrote no report within 30 s" in text


#: rank 0's --wait-s for the other ranks' reports: each rank imports TensorFlow first (~30 s
#: loaded), so a late rank must not be taken for a missing one; a rank that reported ends
#: the wait at once. 60 s was 2x a loaded start.
WAIT_S = "600"


def _doctor(report_dir, *args, env=None):
    """One rank of `tfllm doctor --report-dir`, as a real process of its own group."""
    return start_process(tfllm_command("doctor", "--report-dir", str(report_dir), *args),
                         tfllm_env(**(env or {})))


@pytest.mark.slow  # real processes: two ranks of the doctor on this machine
@pytest.mark.multiprocess
def test_client_0_names_a_port_nobody_listens_on_and_a_port_in_use(tmp_path):
    """Ranks 0 and 1 run as the launcher would start them (DTENSOR_JOBS on 127.0.0.1);
    rank 2's report names a port nobody listens on (its node went away), and a port of
    rank 0 is held by another program: both named, the reachable ports counted."""
    port0, port1, nobody, held_port = free_ports(4)
    jobs = f"127.0.0.1:{port0},127.0.0.1:{port1},127.0.0.1:{nobody}"
    reports = tmp_path / "reports"
    reports.mkdir()
    doctor.write_report(str(reports), {"host": "gone", "rank": 2, "address": "127.0.0.1",
                                       "listening": [nobody], "nonce": "n2", "ports": {},
                                       "gpus": [], "tf_gpus": 0, "nccl_env": {},
                                       "ptxas": None, "findings": [], "tensorflow": "2.21.0",
                                       "cuda": "12.5.1", "cudnn": "9", "nccl": None,
                                       "driver": None})
    with socket.socket() as held:  # bound by another program, not listening
        held.bind(("0.0.0.0", held_port))
        procs = [_doctor(reports, "--wait-s", WAIT_S,
                         *(["--ports", f"{port0},{held_port}"] if rank == 0 else []),
                         env={"DTENSOR_JOBS": jobs, "DTENSOR_CLIENT_ID": str(rank)})
                 for rank in (1, 0)]
        (code1, out1, err1), (code0, out0, err0) = [finish(p, TF_HANG_S) for p in procs]
    assert code1 == 0, err1[-2000:]
    assert "ok: rank 1 wrote" in out1
    assert code0 == 2, (out0, err0[-2000:])
    assert (f"error: client 0 cannot reach gone (rank 2) at 127.0.0.1:{nobody}: connection "
            "refused; likely a firewall on that node rejects the port") in out0
    assert f"port {held_port} is in use" in out0
    assert "ok: client 0 reached 2 of 3 job ports of 3 ranks" in out0
    assert "ok: no GPU: bandwidth test skipped" in out0
    assert "3 of 3 nodes reported" in out0
    assert_no_leftovers(tmp_path)


@pytest.mark.slow  # real processes: the launcher's local mode starts two ranks
@pytest.mark.multiprocess
def test_the_launcher_starts_the_doctor_on_the_jobs_own_ports(tmp_path):
    """`tfllm launch --mode local -- tfllm doctor`: each rank listens on the free port the
    launcher holds for it (SO_REUSEPORT, as its worker's gRPC server would bind it) and
    client 0 reaches both; nothing is left running."""
    code, out, err = run_launcher(["--mode", "local", "--num-workers", "2", "--log-dir",
                                   str(tmp_path / "logs"), "--", PY, "-m", "tfllm.cli.main",
                                   "doctor", "--report-dir", str(tmp_path / "reports"),
                                   "--wait-s", WAIT_S], timeout=TF_HANG_S)
    assert code == 0, (out[-3000:], err[-3000:])
    assert "[rank 0] ok: client 0 reached 2 of 2 job ports of 2 ranks" in out
    assert "[rank 0] ok: no GPU: bandwidth test skipped" in out
    assert "[rank 0] ok: 2 of 2 nodes reported" in out
    assert "[rank 1] ok: rank 1 wrote" in out
    assert_no_leftovers(tmp_path)


@pytest.mark.slow  # two real DTensor clients on CPUs
@pytest.mark.multiprocess
def test_the_bandwidth_code_runs_over_tensorflows_ring_collectives_on_cpus(tmp_path):
    """The doctor's all-reduce test as GPU nodes run it (`allreduce.run_client`, its own
    process per client, NCCL's log read back), with CPU devices: TensorFlow's ring
    collectives over gRPC instead of NCCL, so no transport is logged."""
    jobs = ",".join(f"localhost:{p}" for p in free_ports(2))
    env = tfllm_env()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda rank: allreduce.run_client(
            jobs, rank, env, timeout_s=TF_HANG_S, device="CPU", sizes_mb=(0.25, 1),
            iterations=2), range(2)))
    for rank, result in enumerate(results):
        assert "error" not in result, result
        assert (result["client"], result["devices"]) == (rank, 2)
        assert [r["bytes"] for r in result["results"]] == [1 << 18, 1 << 20]
        for r in result["results"]:  # two devices: bus = algorithm bandwidth
            assert r["algbw_gbs"] > 0 and r["busbw_gbs"] == r["algbw_gbs"]
        assert result["transports"] == {} and result["network"] == ""


@pytest.mark.slow  # a real two-node Slurm (tests/launch/conftest.py)
@pytest.mark.multiprocess
def test_srun_doctor_reports_every_node(real_slurm, tmp_path):
    env = dict(tfllm_env(), **{k: v for k, v in real_slurm.env.items()
                               if k in ("SLURM_CONF", "PATH")})
    result = subprocess.run(["srun", "-N2", "-n2", "--ntasks-per-node=1",
                             *tfllm_command("doctor", "--report-dir", str(tmp_path),
                                            "--ports", "0", "--wait-s", WAIT_S)],
                            env=env, capture_output=True, text=True, timeout=TF_HANG_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 of 2 nodes reported: TensorFlow" in result.stdout, result.stdout
    assert "rank 1 wrote" in result.stdout
    # each rank listened on a free port (--ports 0); client 0 reached both by node name
    assert "ok: client 0 reached 2 of 2 job ports of 2 ranks" in result.stdout
