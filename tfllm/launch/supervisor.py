"""Starting, watching and stopping the workers of one multi-client job.

A DTensor job cannot continue with a client missing (the others would block in a
collective), so the supervisor treats its workers as one unit: when one exits non-zero
every other is stopped (SIGTERM to its process group, SIGKILL after the kill timeout),
and a restart starts all of them again. Each worker runs in a process group of its own,
so stopping it stops what it started. Output is prefixed `[rank N]` on stdout and kept
raw in LOG_DIR/rank_N.log. Readiness is a handshake: a worker on this host creates its
TFLLM_READY_FILE, one on another host prints the line with its TFLLM_READY_KEY (tfllm
does both once its mesh is up; building a multi-client mesh needs every client, so one
ready worker means all have joined). Other commands may be matched by --ready-pattern.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

from tfllm import files
from tfllm.contracts import (BAD_INPUT_EXIT_CODE, IO_ERROR_EXIT_CODE, PEER_LOST_EXIT_CODE,
                              PREEMPTED_EXIT_CODE, STARTUP_TIMEOUT_EXIT_CODE)
from tfllm.contracts import READY_LINE
from tfllm.launch.topology import WorkerSpec
from tfllm.runpaths import LaunchLogs

_POLL_S = 0.2
#: how long a lost-peer exit (76) waits for the rank that really failed to show
_CAUSE_GRACE_S = 2.0
#: ssh's own exit code when the connection failed or dropped (the remote command's is
#: passed through otherwise): for the job that is a lost peer
SSH_CONNECTION_LOST = 255
#: worker exit codes that a restart would only repeat: bad input, failed storage
FINAL_CODES = {BAD_INPUT_EXIT_CODE: "bad input", IO_ERROR_EXIT_CODE: "the storage failed"}


@dataclass
class Worker:
    """A started worker: its spec, process and output reader."""

    spec: WorkerSpec
    process: subprocess.Popen
    reader: threading.Thread
    ready_file: str
    matched: threading.Event
    ready_line: Optional[str] = None
    code: Optional[int] = None
    remote: bool = False


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128+N when signal N killed the process."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Runs one attempt of the job at a time; see the module docstring.

    Args:
      command: the worker command (hostfile mode: the remote shell's words come first).
      log_dir: where rank_N.log, ready.N and pids go.
      kill_timeout: seconds between SIGTERM and SIGKILL when stopping.
      startup_timeout: seconds for a worker to become ready (0: wait forever).
      ready_pattern: a compiled regex that also marks readiness, or None.
      say: prints a launcher message (stderr).
      out: where prefixed worker output goes.
      forward_signals: send the workers SIGTERM when the launcher gets a signal. False
        under Slurm, which signals every process of a step itself (scancel, --signal, a
        time limit, preemption): a second SIGTERM from us would make tfllm stop at once
        without saving. The launcher then just waits for its worker's own exit.
    """

    def __init__(self, log_dir: str, kill_timeout: int, startup_timeout: int,
                 ready_pattern: Optional[re.Pattern] = None,
                 say: Callable[[str], None] = print, out=None, forward_signals: bool = True):
        self.log_dir = log_dir
        self.kill_timeout = kill_timeout
        self.startup_timeout = startup_timeout
        self.ready_pattern = ready_pattern
        self.say = say
        self.out = out if out is not None else sys.stdout
        self.workers: Dict[int, Worker] = {}
        self.signal_received = 0
        self.forward_signals = forward_signals
        self._out_lock = threading.Lock()

    # ---- signals -----------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGINT, SIGTERM and SIGHUP stop the workers (forwarded as SIGTERM)."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = signum

    # ---- one attempt -------------------------------------------------------------------------
    def ready_file(self, rank: int) -> str:
        return LaunchLogs(self.log_dir).ready(rank)

    def start(self, spec: WorkerSpec, argv: Sequence[str], attempt: int,
              remote: bool = False, stdin_data: bytes = b"") -> None:
        """Starts one worker in its own process group.

        Args:
          argv: what to execute: the command with `spec.env` set, or (remote) the remote
            shell whose script sets `spec.env` on the other host.
          remote: hostfile mode: ssh gets our environment only, and its stdin is held
            open so that the remote watcher stops the worker when ssh is stopped.
          stdin_data: (remote) what the remote script reads first: its secrets.
        """
        log_path = LaunchLogs(self.log_dir).rank_log(spec.rank)
        ready = self.ready_file(spec.rank)
        files.remove(self.log_dir, ready)  # the previous attempt's (tfllm's name: ready.N)
        with files.open_for_writing(self.log_dir, log_path, "a", append=True) as log:
            log.write(f"=== multiworker: rank {spec.rank} attempt {attempt} started "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} ===\n")
        env = dict(os.environ) if remote else dict(os.environ, **spec.env)
        process = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT,
                                   stdin=subprocess.PIPE if remote else subprocess.DEVNULL,
                                   start_new_session=True)
        if remote and stdin_data:
            try:  # a few bytes: the pipe takes them without waiting; it stays open
                process.stdin.write(stdin_data)
                process.stdin.flush()
            except OSError:  # ssh already gone: its exit is reported like any other
                pass
        matched = threading.Event()
        key = spec.env.get("TFLLM_READY_KEY")
        ready_line = READY_LINE.format(key) if key else None
        reader = threading.Thread(target=self._read, args=(spec.rank, process, log_path,
                                                           matched, ready_line), daemon=True)
        reader.start()
        self.workers[spec.rank] = Worker(spec, process, reader, ready, matched, ready_line,
                                         remote=remote)
        with files.open_for_writing(self.log_dir, LaunchLogs(self.log_dir).pids, "a", append=True) as f:
            f.write(f"{spec.rank} {process.pid}\n")

    def _read(self, rank: int, process, log_path: str, matched: threading.Event,
              ready_line: Optional[str]) -> None:
        """Tees the worker's output: raw to its log, prefixed to our stdout."""
        with files.open_for_writing(self.log_dir, log_path, "ab", append=True,
                                    buffering=0) as log:
            for raw in iter(process.stdout.readline, b""):
                log.write(raw)
                line = raw.decode("utf-8", "replace").rstrip("\n")
                with self._out_lock:
                    self.out.write(f"[rank {rank}] {line}\n")
                    self.out.flush()
                if not matched.is_set() and (
                        line.strip() == ready_line or (self.ready_pattern is not None
                                                       and self.ready_pattern.search(line))):
                    matched.set()
        process.stdout.close()

    def is_ready(self) -> bool:
        return any(os.path.exists(w.ready_file) or w.matched.is_set()
                   for w in self.workers.values())

    def run_attempt(self, start_all: Callable[[], None]) -> int:
        """Starts the workers (`start_all`) and watches them; the attempt's exit code."""
        self.workers = {}
        files.open_for_writing(self.log_dir, LaunchLogs(self.log_dir).pids).close()
        start_all()
        started, ready, told = time.monotonic(), False, False
        while True:
            if self.signal_received and not self.forward_signals and not told:
                told = True
                self.say(f"received signal {self.signal_received}; not forwarding it: the "
                         "scheduler signals the workers itself (a second SIGTERM would stop "
                         "tfllm without saving)")
            elif self.signal_received and self.forward_signals:
                self.say(f"received signal {self.signal_received}; sending SIGTERM to the "
                         f"workers (SIGKILL after {self.kill_timeout} s)")
                self.stop_all()
                if any(w.code == PREEMPTED_EXIT_CODE for w in self.workers.values()):
                    return PREEMPTED_EXIT_CODE
                return 128 + self.signal_received
            alive, failed = self._sweep()
            if failed:
                rank, code = self._first_cause(failed)
                self.say(f"rank {rank} exited with code {code}; stopping the other "
                         f"workers (log: {LaunchLogs(self.log_dir).rank_log(rank)})")
                self.stop_all()
                return code
            if not alive:
                self._drain()
                return 0
            if not ready and self.is_ready():
                ready = True
                self.say(f"workers ready after {time.monotonic() - started:.0f} s")
            if (not ready and self.startup_timeout > 0
                    and time.monotonic() - started >= self.startup_timeout):
                self.say(f"error: no worker became ready within --startup-timeout "
                         f"{self.startup_timeout} s; a worker may be waiting for one that "
                         f"never joined. Check {self.log_dir}/rank_*.log and that every host "
                         "reaches the DTENSOR_JOBS ports; raise --startup-timeout for slow "
                         "starts.")
                self.stop_all()
                return STARTUP_TIMEOUT_EXIT_CODE
            time.sleep(_POLL_S)

    def _sweep(self):
        """Polls every worker once: (any still running, [(rank, code)] of new failures)."""
        alive, failed = False, []
        for rank, worker in sorted(self.workers.items()):
            if worker.code is not None:
                continue
            returncode = worker.process.poll()
            if returncode is None:
                alive = True
                continue
            worker.code = exit_status(returncode)
            if worker.remote and worker.code == SSH_CONNECTION_LOST:
                self.say(f"rank {rank}: the ssh connection to {worker.spec.host} was lost "
                         f"(ssh exited {SSH_CONNECTION_LOST}); reporting it as a lost peer, "
                         f"code {PEER_LOST_EXIT_CODE}")
                worker.code = PEER_LOST_EXIT_CODE
            _signal_group(worker.process.pid, signal.SIGTERM)  # nothing outlives it
            if worker.code != 0:
                failed.append((rank, worker.code))
        return alive, failed

    def _first_cause(self, failed):
        """The failure to report: a rank that died, not one that only lost it.

        A survivor exits PEER_LOST_EXIT_CODE within milliseconds of its peer's death,
        often before the dead rank's exit is seen; so when every failure so far is a
        lost peer, the others get `_CAUSE_GRACE_S` to show their own code.
        """
        deadline = time.monotonic() + _CAUSE_GRACE_S
        while all(code == PEER_LOST_EXIT_CODE for _, code in failed):
            alive, more = self._sweep()
            failed = failed + more
            if not alive or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S / 4)
        return next(((r, c) for r, c in failed if c != PEER_LOST_EXIT_CODE), failed[0])

    def stop_all(self) -> None:
        """SIGTERM every worker's process group; SIGKILL what is left after the timeout."""
        for worker in self.workers.values():
            _signal_group(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_timeout
        while time.monotonic() < deadline and self._any_alive():
            time.sleep(_POLL_S)
        for rank, worker in sorted(self.workers.items()):
            worker.process.poll()
            if _group_alive(worker.process.pid):
                self.say(f"rank {rank} did not stop within --kill-timeout "
                         f"{self.kill_timeout} s; sending SIGKILL")
                _signal_group(worker.process.pid, signal.SIGKILL)
        self._drain()

    def _any_alive(self) -> bool:
        for worker in self.workers.values():
            worker.process.poll()  # reap an exited leader: a zombie still "exists"
        return any(_group_alive(w.process.pid) for w in self.workers.values())

    def _drain(self) -> None:
        """Collects exit codes and waits for the output readers to finish."""
        for worker in self.workers.values():
            returncode = worker.process.wait()
            if worker.code is None:
                worker.code = exit_status(returncode)
            worker.reader.join(timeout=10)

    def kill_all(self) -> None:
        """Last resort (the launcher is exiting): SIGKILL every group still alive."""
        for worker in self.workers.values():
            if _group_alive(worker.process.pid):
                _signal_group(worker.process.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is alive (zombies of reaped leaders do not count)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def run_job(supervisor: Supervisor, start_all: Callable[[int], None], max_restarts: int,
            say: Callable[[str], None]) -> int:
    """Attempts until success, a signal, or the restart budget is spent; the exit code."""
    attempt = 0
    while True:
        code = supervisor.run_attempt(lambda: start_all(attempt))
        if code == 0:
            say("all workers exited 0")
            return 0
        final = code in FINAL_CODES
        if final and attempt < max_restarts and not supervisor.signal_received:
            say(f"not restarting: code {code} means {FINAL_CODES[code]}, which a restart "
                "would meet again; fix it (the worker's log says what) and run the job "
                "again")
        if supervisor.signal_received or attempt >= max_restarts or final:
            say(f"exiting with code {code}")
            return code
        attempt += 1
        say(f"restarting all workers (restart {attempt} of --max-restarts {max_restarts})")

