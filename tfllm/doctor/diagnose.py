"""The findings `tfllm doctor` prints, assembled in one place (the CLI only parses and
prints them)."""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional

from tfllm.runtime import gpu_checks


class JobOptionError(ValueError):
    """A rank, world size or port list that is not whole numbers."""


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """`--report-dir` and its companions: this rank's part of a job's doctor."""
    report_dir: str
    rank: Optional[int] = None
    world_size: Optional[int] = None
    ports: Optional[str] = None  # "P1,P2,..."
    wait_s: int = 120


def diagnose(config, with_config: bool, job: Optional[JobOptions] = None
             ) -> List[gpu_checks.Finding]:
    """Every finding for this host and `config`, in the order they are printed.

    Args:
      config: the run's resolved config (precision and mesh device type are always read).
      with_config: whether the user named a config (`--config`): then whether its step fits
        this host's GPUs (or one node of 8 where it has none) is a finding too.
      job: with `--report-dir`, this rank writes its report and rank 0 returns the job's
        findings (`tfllm.doctor.job.run`).

    Raises:
      JobOptionError: a rank, world size or port list that is not whole numbers.
    """
    facts = gpu_checks.gather()
    findings = gpu_checks.check(facts, config.precision.policy, config.mesh.device_type)
    if with_config:  # a run's config: will its step fit the GPUs' memory?
        from tfllm.contracts import num_clients
        from tfllm.footprint.fit import doctor_finding, host_gpus
        level, message = doctor_finding(config, host_gpus(facts.driver_gpus, facts.environ),
                                        num_clients())
        findings.append(gpu_checks.Finding(level, message))
    if job is not None:
        from tfllm.doctor import job as job_doctor
        try:
            rank, size = job_doctor.rank_and_size(os.environ, job.rank, job.world_size)
            ports = job_doctor.node_ports(os.environ, rank, job.ports)
        except ValueError as e:
            raise JobOptionError(str(e)) from e
        findings = job_doctor.run(job.report_dir, facts, findings, rank, size, ports,
                                  job.wait_s)
    return findings
