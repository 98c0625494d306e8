"""The exit code a Slurm rank's launcher reports (tfllm.launch.scheduler): its logic, and a
rank's code surviving the signal srun sends while it exits."""

import os
import subprocess
import sys

import pytest

from tfllm.launch import scheduler
from tests.harness import ROOT

ENV = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "0"}


def _code(tmp_path, rank, code, signalled, env=ENV):
    return scheduler.exit_code(str(tmp_path), rank, 2, code, signalled, env, lambda m: None)


def test_a_stopped_rank_exits_0_when_another_rank_failed_first(tmp_path):
    assert _code(tmp_path, 1, 3, False) == 3  # the cause keeps its code
    assert _code(tmp_path, 0, 76, True) == 0  # so srun -K's highest code is the cause's


def test_every_rank_keeps_75_when_all_were_signalled(tmp_path, monkeypatch):
    monkeypatch.setattr(scheduler, "CAUSE_GRACE_S", 0.1)
    assert _code(tmp_path, 0, 75, True) == 75
    assert _code(tmp_path, 1, 75, True) == 75


def test_an_earlier_jobs_record_is_not_a_cause(tmp_path, monkeypatch):
    monkeypatch.setattr(scheduler, "CAUSE_GRACE_S", 0.1)
    _code(tmp_path, 1, 3, False, dict(ENV, SLURM_RESTART_COUNT="1"))  # before a requeue
    assert _code(tmp_path, 0, 76, False, dict(ENV, SLURM_RESTART_COUNT="2")) == 76


def test_outside_slurm_nothing_is_recorded(tmp_path):
    assert _code(tmp_path, 0, 143, True, {}) == 143
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # starts a Python process (signals must not reach this one)
def test_a_decided_rank_keeps_its_code_through_a_late_sigterm():
    # srun --kill-on-bad-exit SIGTERMs a rank that is already exiting 75 after a save: its
    # code must stay 75, not become 143 (Python restores default handlers at shutdown).
    script = ("import os, signal, sys\n"
              "from tfllm.launch import scheduler\n"
              "signal.signal(signal.SIGTERM, lambda *a: None)\n"
              "scheduler.hold_late_signals()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "sys.exit(75)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 75
    # without it, the same late signal after the handlers are gone kills the process
    bare = script.replace("scheduler.hold_late_signals()\n",
                          "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n")
    assert subprocess.run([sys.executable, "-c", bare], cwd=ROOT, timeout=60,
                          env=dict(os.environ, PYTHONPATH=ROOT)).returncode == -15
