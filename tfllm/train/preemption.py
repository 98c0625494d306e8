"""Graceful stops: SIGTERM / SIGINT finish the current step, save, and exit 75.

Clusters announce preemption with SIGTERM (SLURM, Kubernetes) and users press Ctrl-C.
The first signal only sets a flag; the loop checks it at each step boundary (after the
first compilation, after an evaluation), saves a checkpoint and exits with
`PREEMPTED_EXIT_CODE` (75). A second signal stops at once without saving (exit 130). The
codes live in `tfllm.contracts`.
"""

from __future__ import annotations

import os
import signal

from tfllm import quiet
from tfllm.contracts import HARD_STOP_EXIT_CODE


class Preempted(Exception):
    """The run saved its state after a signal and should exit `PREEMPTED_EXIT_CODE`
    (tfllm.contracts)."""

    def __init__(self, step: int, signame: str):
        super().__init__(f"stopped by {signame} after step {step}; the checkpoint of step "
                         f"{step} is saved, run the same command to resume.")
        self.step = step


class NonFiniteError(RuntimeError):
    """The loss or gradient norm was NaN/Inf under train.on_nonfinite=abort."""


class SignalWatcher:
    """Turns SIGTERM/SIGINT into a flag while active (a context manager)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signame = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signame is not None

    def _handle(self, signum, frame):
        if self.signame is not None:  # the second signal: give up at once
            name = signal.Signals(signum).name
            os.write(2, f"tfllm train: stopped at once by a second signal ({name}); nothing "
                        "was saved, the latest committed checkpoint stays the latest.\n"
                        .encode())
            quiet.release()  # the line through the command's stderr filter before _exit
            os._exit(HARD_STOP_EXIT_CODE)
        self.signame = signal.Signals(signum).name

    def __enter__(self):
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a notebook worker)
                pass
        # Nested in an outer watcher (the command's, entered before TensorFlow is even
        # imported): a signal it caught during set-up is this one's first, so that the
        # next one is the second (exit 130), and the loop stops at its first boundary.
        outer = getattr(self._previous.get(signal.SIGTERM), "__self__", None)
        if isinstance(outer, SignalWatcher) and self.signame is None:
            self.signame = outer.signame
        return self

    def reinstall(self) -> None:
        """Takes SIGTERM back after TensorFlow's multi-client start-up: its coordination
        service installs its own SIGTERM handler (the preemption notifier of
        tsl/distributed_runtime/preemption), which swallowed the signal, so a client
        that alone was asked to stop trained on to the end."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False
