"""Graceful stops: SIGTERM / SIGINT finish the current step, save, and exit 75.

Clusters announce preemption with SIGTERM (SLURM, Kubernetes) and users press Ctrl-C.
The first signal only sets a flag; the loop checks it at each step boundary (after the
first compilation, after an evaluation), saves a checkpoint and exits with
`PREEMPTED_EXIT_CODE` (75). A second signal stops at once without saving (exit 130). The
codes live in `tfllm.contracts`.

"At once" in every phase: Python runs a signal's handler only when the main thread is
back in Python, which a long call into C++ (the corpus build in tf.data, SentencePiece's
training, a compilation) delays by as long as it runs. So while a watcher is active, the
signals also reach a thread through Python's wakeup file descriptor (written by the C
handler as the signal arrives, `signal.set_wakeup_fd`), which counts them and stops the
process on the second, whatever the main thread is doing.
"""

from __future__ import annotations

import os
import signal
import threading
import time

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


#: taken by whichever of the handler and the counting thread stops the process first
_STOPPING = threading.Lock()


def _stop_at_once(signum: int) -> None:
    """The second signal: one line, then exit 130 without saving."""
    if not _STOPPING.acquire(blocking=False):  # the other one is saying it and exiting
        while True:
            time.sleep(1)
    name = signal.Signals(signum).name
    os.write(2, f"tfllm train: stopped at once by a second signal ({name}); nothing "
                "was saved, the latest committed checkpoint stays the latest.\n".encode())
    quiet.release()  # the line through the command's stderr filter before _exit
    os._exit(HARD_STOP_EXIT_CODE)


class _Counter:
    """Counts SIGTERM/SIGINT while the outermost watcher is active, from the wakeup
    descriptor, in a thread (see the module); one per process. Each activation has its
    own pipe and thread, whose count is its own: a signal of an earlier one, read late,
    never adds to a later one's."""

    def __init__(self):
        self.lock = threading.Lock()
        self.depth = 0
        self._previous_fd, self._write_fd = -1, None

    def enter(self) -> None:
        with self.lock:
            self.depth += 1
            if self.depth > 1 or self._write_fd is not None:
                return
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)  # the C handler must never block
            try:
                self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            except ValueError:  # not the main thread: Python's handlers alone
                os.close(read_fd)
                os.close(write_fd)
                return
            self._write_fd = write_fd
            threading.Thread(target=self._read, args=(read_fd,), daemon=True,
                             name="tfllm-second-signal").start()

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth > 0 or self._write_fd is None:
                return
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._write_fd)  # the thread reads the end of the pipe and ends
            self._write_fd = None

    @staticmethod
    def _read(read_fd: int) -> None:
        watched, seen = {int(s) for s in SignalWatcher.SIGNALS}, 0
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(64)
                if not data:  # the watcher ended
                    return
                for signum in data:
                    seen += signum in watched
                    if seen >= 2:
                        _stop_at_once(signum)


_COUNTER = _Counter()


class SignalWatcher:
    """Turns SIGTERM/SIGINT into a flag while active (a context manager); a second signal
    stops the process at once (see the module)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signame = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signame is not None

    def _handle(self, signum, frame):
        if self.signame is not None:  # the second signal: give up at once
            _stop_at_once(signum)
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
        _COUNTER.enter()
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
        _COUNTER.exit()
        return False
