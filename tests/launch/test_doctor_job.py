"""The doctor for many nodes (tfllm.launch.doctor): each rank writes its node's findings,
rank 0 prints one report for the job: versions, GPUs, ports and NCCL settings compared
across nodes, missing ranks named."""

import socket
import subprocess

import pytest

from tfllm.cli.main import main
from tfllm.launch import doctor
from tests.harness import tfllm_command, tfllm_env


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


def test_ranks_write_and_rank_0_reports_the_job(tmp_path, capsys):
    with socket.socket() as held:  # a port in use on this "node"
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        common = ["doctor", "--report-dir", str(tmp_path), "--world-size", "2",
                  "--ports", str(port), "--wait-s", "5"]
        assert main([*common, "--rank", "1"]) == 0
        assert "rank 1 wrote" in capsys.readouterr().out
        assert main([*common, "--rank", "0"]) == 2
    out = capsys.readouterr().out
    assert f"port {port} is in use" in out and "2 of 2 nodes reported" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doctor.rank_0.json",
                                                           "doctor.rank_1.json"]


@pytest.mark.slow  # a real two-node Slurm (tests/launch/conftest.py)
@pytest.mark.multiprocess
def test_srun_doctor_reports_every_node(real_slurm, tmp_path):
    env = dict(tfllm_env(), **{k: v for k, v in real_slurm.env.items()
                               if k in ("SLURM_CONF", "PATH")})
    result = subprocess.run(["srun", "-N2", "-n2", "--ntasks-per-node=1",
                             *tfllm_command("doctor", "--report-dir", str(tmp_path),
                                            "--ports", "0", "--wait-s", "60")],
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 of 2 nodes reported: TensorFlow" in result.stdout, result.stdout
    assert "rank 1 wrote" in result.stdout
