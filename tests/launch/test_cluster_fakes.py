"""Tests never reach a real Slurm or ssh: the fakes of tests/conftest.py come first on PATH.

A failing `scontrol` (and srun, sbatch, ssh) placed behind the fakes stands for a real
Slurm installed on the machine: nothing a test does may call it.
"""

import os
import shutil
import subprocess

import pytest

from tests.harness import CLUSTER_TOOLS, FAKE_TOOL_EXIT
from tests.launch.helpers import launcher_env, run
from tfllm.launch.main import make_plan, parse

SLURM_RANK = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}

_FAILING = """#!/bin/sh
# What a real {tool} is to these tests: a failure that leaves a mark.
echo "{tool} $*" >> '{marks}'
exit 1
"""


def _real_slurm(directory):
    """A bin directory of failing srun, sbatch, scontrol, ssh; returns (bin dir, marks file)."""
    bin_dir, marks = os.path.join(str(directory), "real-bin"), os.path.join(str(directory), "marks")
    os.makedirs(bin_dir)
    for tool in ("srun", "sbatch", "scontrol", "ssh"):
        path = os.path.join(bin_dir, tool)
        with open(path, "w") as f:
            f.write(_FAILING.format(tool=tool, marks=marks))
        os.chmod(path, 0o755)
    return bin_dir, marks


def _slurm_plan_nodes():
    # A slurm rank's plan expands its nodelist with `scontrol show hostnames` when scontrol
    # is on PATH (tfllm.launch.main.expand_nodelist): the call a real Slurm answered.
    plan = make_plan(parse(["--mode", "slurm", "--", "true"]), SLURM_RANK)
    return plan.topology.hosts


def test_a_real_slurm_behind_the_fakes_is_never_reached(tmp_path, monkeypatch, cluster_tools):
    fakes, calls = cluster_tools
    real, marks = _real_slurm(tmp_path)
    monkeypatch.setenv("PATH", os.environ["PATH"] + os.pathsep + real)
    for tool in CLUSTER_TOOLS:
        assert os.path.dirname(shutil.which(tool)) == fakes, tool
    # In this process: the plan's nodelist comes from the fake scontrol.
    assert _slurm_plan_nodes() == ["n1", "n2"]
    assert open(calls).read().splitlines()[-1] == "scontrol show hostnames n[1-2]"
    # A launcher started as the launch tests start it.
    code, out, err = run(["--mode", "slurm", "--dry-run", "--", "tfllm", "train"],
                         env=launcher_env(PATH=os.environ["PATH"], **SLURM_RANK))
    assert code == 0, err
    assert "DTENSOR_JOBS=n1:" in out
    # A tool nobody faked on purpose fails loudly instead of reaching the real one.
    for tool in ("srun", "sbatch", "ssh"):
        result = subprocess.run([tool, "-N2", "true"], capture_output=True, text=True, timeout=30)
        assert result.returncode == FAKE_TOOL_EXIT and f"fake {tool}" in result.stderr
    assert not os.path.exists(marks)


def test_without_the_fakes_the_failing_scontrol_is_reached(tmp_path, monkeypatch, cluster_tools):
    # The same plan with the failing scontrol first: the check above can fail.
    real, marks = _real_slurm(tmp_path)
    monkeypatch.setenv("PATH", real + os.pathsep + os.environ["PATH"])
    with pytest.raises(subprocess.CalledProcessError):
        _slurm_plan_nodes()
    assert open(marks).read().split() == ["scontrol", "show", "hostnames", "n[1-2]"]
