"""The exit code a rank's launcher gives a scheduler that starts one launcher per rank.

Under `srun --kill-on-bad-exit=1` the first rank to fail makes Slurm SIGTERM the others,
and srun returns the HIGHEST task exit code: the killed ranks' 143 (or 75, 76, 137) would
hide the failing rank's own code (a 2 for bad input, a 3 for NaN). So each launcher
records its outcome in the shared log directory (`exit.RANK`), and a rank whose outcome is
only a consequence (its launcher got the scheduler's signal, or its worker lost a peer,
76) exits 0 when another rank of the same job step recorded a cause: srun then returns
the cause's code. With no cause anywhere (scancel: every rank signalled and saved), each
rank keeps its own code, 75 after a save.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Mapping, Optional, Tuple

from tfllm import files
from tfllm.contracts import PEER_LOST_EXIT_CODE
from tfllm.runpaths import LaunchLogs

#: how long a consequence waits for the failing rank's record to appear
CAUSE_GRACE_S = 3.0


def job_key(environ: Mapping[str, str]) -> Optional[str]:
    """This Slurm job step and requeue count (a requeued job keeps its id), or None."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    return ".".join(environ.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID",
                                                   "SLURM_RESTART_COUNT"))


def is_consequence(code: int, signalled: bool) -> bool:
    """Whether this outcome follows another rank's failure rather than causing one."""
    return code != 0 and (signalled or code == PEER_LOST_EXIT_CODE)


def record(log_dir: str, rank: int, key: str, code: int, signalled: bool) -> None:
    path = LaunchLogs(log_dir).exit_record(rank)
    files.write_atomically(log_dir, path, f"{key} {code} {int(signalled)}\n")


def _read(log_dir: str, rank: int, key: str) -> Optional[Tuple[int, bool]]:
    try:
        words = open(LaunchLogs(log_dir).exit_record(rank)).read().split()
    except OSError:
        return None
    if len(words) != 3 or words[0] != key:  # an earlier job's record
        return None
    return int(words[1]), words[2] == "1"


def find_cause(log_dir: str, rank: int, world_size: int, key: str,
               grace_s: Optional[float] = None) -> Optional[Tuple[int, int]]:
    """Another rank of this step that failed on its own: (rank, code), or None."""
    deadline = time.monotonic() + (CAUSE_GRACE_S if grace_s is None else grace_s)
    while True:
        for other in range(world_size):
            outcome = _read(log_dir, other, key) if other != rank else None
            if outcome and not is_consequence(*outcome) and outcome[0] != 0:
                return other, outcome[0]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def exit_code(log_dir: str, rank: int, world_size: int, code: int, signalled: bool,
              environ: Mapping[str, str], say: Callable[[str], None]) -> int:
    """Records this rank's outcome; the code for its scheduler (see the module docstring)."""
    key = job_key(environ)
    if key is None:
        return code
    try:
        record(log_dir, rank, key, code, signalled)
    except OSError:
        return code
    if not is_consequence(code, signalled):
        return code
    cause = find_cause(log_dir, rank, world_size, key)
    if cause is None:
        return code
    say(f"rank {cause[0]} failed first with code {cause[1]}; this rank ({code}) was stopped "
        f"because of it and exits 0, so that srun reports code {cause[1]}")
    return 0


def hold_late_signals() -> None:
    """Blocks SIGINT, SIGTERM and SIGHUP for the rest of this launcher's life.

    Once a rank's code is decided its worker is gone and nothing is left to stop or save.
    But `srun --kill-on-bad-exit` SIGTERMs the tasks still running as soon as one exits
    non-zero (75 after a scancel's save), and Python restores the default handlers while
    it shuts down: a SIGTERM in that window killed a rank that had saved and returned 75,
    srun then reported 143 (seen on a loaded machine in tests/launch/test_real_slurm.py).
    A blocked signal stays pending and the process exits with its own code.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
