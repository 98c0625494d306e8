"""A lost peer ends a multi-client run with one line, not a hang.

When a client of a DTensor multi-client job dies (crash, SIGKILL, a lost host) or hangs
(SIGSTOP, a wedged driver), the others block in their next collective, on CPU for ever
(measured: a survivor still waiting 9 minutes after its peer was SIGKILLed). Each client
therefore writes a heartbeat, `WORKDIR/logs/heartbeat.N` (the workdir is shared, as the
checkpoints require), every few seconds from a thread. Client 0 watches every other
client's heartbeat; the others watch client 0's only, so the reads per interval grow with
the client count, not with its square. A peer whose heartbeat has not changed for
`train.peer_timeout_s` seconds, as seen by the watcher's own clock (hosts' clocks may
disagree), is lost. Client 0 then writes the verdict into its own heartbeat ("lost":
peer and silence) before it leaves, so every client names the same lost peer within one
interval; a lost client 0 is seen by all the others. The client then prints one line
naming the peer, its own step and the latest committed checkpoint, and exits with
`PEER_LOST_EXIT_CODE` at once: its main thread is blocked inside a collective, where no
exception could reach it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from tfllm import files
from tfllm.contracts import PEER_LOST_EXIT_CODE
from tfllm.runpaths import RunPaths


class PeerLost(RuntimeError):
    """Another client of the job died or stopped responding; the message is one line."""


# A peer named in a collective's error: ".../job:worker/replica:0/task:1 while calling ...".
_TASK = re.compile(r"/job:[\w-]+/replica:\d+/task:(\d+)")
_PEER_ERRORS = ("Collective ops is aborted", "Connection reset by peer", "Socket closed",
                "failed to connect", "unavailable", "Deadline Exceeded")


def peer_from_error(message: str, own: int) -> Optional[int]:
    """The peer a TensorFlow collective error blames (-1: a peer, which one unknown), or
    None when the error is not about a lost peer."""
    for match in _TASK.finditer(message):
        if int(match.group(1)) != own:
            return int(match.group(1))
    if any(text.lower() in message.lower() for text in _PEER_ERRORS):
        return -1
    return None


def lost_message(peer: int, client: int, step: int, latest: Optional[int],
                 why: str) -> str:
    """The one line a surviving client prints (by the watchdog or on a collective error)."""
    who = f"client {peer}" if peer >= 0 else "a peer client"
    where = (f"the latest committed checkpoint is step {latest}" if latest is not None
             else "no checkpoint is committed yet")
    return (f"{who} stopped responding ({why}) while client {client} was at step {step}; "
            f"{where}. Exiting with code {PEER_LOST_EXIT_CODE}: restart the job to resume.")


def heartbeat_path(workdir: str, client: int) -> str:
    """WORKDIR/logs/heartbeat.N (`tfllm.runpaths`)."""
    return RunPaths(workdir).heartbeat(client)


class PeerWatchdog:
    """Heartbeats of this client and a watch over the others' (a daemon thread).

    Args:
      workdir: the run directory shared by all clients.
      client: this client's id.
      clients: the client count.
      timeout_s: silence after which a peer is lost.
      latest_checkpoint: returns the latest committed step (or None), for the message.
      exit: how to leave (tests pass a recorder); default `os._exit`.
      out: where the line goes (default stderr).
    """

    def __init__(self, workdir: str, client: int, clients: int, timeout_s: float,
                 latest_checkpoint: Callable[[], Optional[int]] = lambda: None,
                 exit: Callable[[int], None] = os._exit, out=None):
        self.workdir, self.client, self.clients = workdir, client, clients
        self.timeout_s = timeout_s
        self.interval_s = max(0.2, min(2.0, timeout_s / 5))
        self.latest_checkpoint = latest_checkpoint
        self._exit = exit
        self.out = out
        self.step = 0
        self._beat = 0
        self._stop = threading.Event()
        self._verdict: Optional[Tuple[int, float]] = None
        self._thread = threading.Thread(target=self._run, name="tfllm-peer-watchdog",
                                        daemon=True)
        # peer -> (last heartbeat content seen, our monotonic time when it last changed)
        self._seen: Dict[int, Tuple[Optional[str], float]] = {}

    def start(self) -> "PeerWatchdog":
        files.make_dirs(RunPaths(self.workdir).logs_dir)  # may be a link: the root
        now = time.monotonic()
        self._seen = {p: (self._read(p), now) for p in self.watched()}
        self._write(done=False)
        self._thread.start()
        return self

    def watched(self) -> list:
        """The clients whose heartbeats this one reads: all others on client 0, else 0."""
        if self.client == 0:
            return [p for p in range(1, self.clients)]
        return [0]

    def stop(self) -> None:
        """This client is finishing normally: peers must not take its silence for a loss."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._write(done=True)

    # ---- heartbeats ----------------------------------------------------------------------------
    def _write(self, done: bool) -> None:
        self._beat += 1
        path = heartbeat_path(self.workdir, self.client)
        record = {"client": self.client, "beat": self._beat, "step": self.step, "done": done,
                  "pid": os.getpid()}
        if self._verdict is not None:
            record["lost"] = {"peer": self._verdict[0], "silent_s": self._verdict[1]}
        try:  # logs/ may be a link (tfllm launch's folder): it is the root of this write
            files.write_atomically(os.path.dirname(path), path, json.dumps(record))
        except (OSError, files.Refused):
            pass  # a full or flaky disk must not stop training; peers may then time out

    def _read(self, peer: int) -> Optional[str]:
        try:
            with open(heartbeat_path(self.workdir, peer)) as f:
                return f.read()
        except OSError:
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write(done=False)
            lost = self.lost_peer(time.monotonic())
            if lost is not None:
                if self.client == 0:
                    self._verdict = lost
                    self._write(done=False)  # the others read the verdict from here
                self._report(*lost)
                return

    def lost_peer(self, now: float) -> Optional[Tuple[int, float]]:
        """(peer, seconds of silence) of the longest-silent lost peer, or None."""
        worst = None
        for peer, (content, changed) in self._seen.items():
            current = self._read(peer)
            if current != content:
                self._seen[peer] = (current, now)
                changed = now
                verdict = _verdict(current)
                if verdict is not None:  # client 0 found a lost peer (since we started)
                    return verdict
            if current is not None and _done(current):
                continue  # it finished (or stopped after a checkpoint): not lost
            silent = now - changed
            if silent > self.timeout_s and (worst is None or silent > worst[1]):
                worst = (peer, silent)
        return worst

    def _report(self, peer: int, silent: float) -> None:
        line = "tfllm train: error: " + lost_message(
            peer, self.client, self.step, self.latest_checkpoint(),
            f"no heartbeat for {silent:.0f} s, train.peer_timeout_s={self.timeout_s:g}")
        if self.out is None:
            from tfllm import quiet
            quiet.release()  # the line must reach the terminal before os._exit
        out = self.out or sys.stderr
        try:
            print(line, file=out, flush=True)
        finally:
            self._exit(PEER_LOST_EXIT_CODE)


def _done(content: str) -> bool:
    try:
        return bool(json.loads(content).get("done"))
    except (ValueError, AttributeError):
        return False


def _verdict(content: Optional[str]) -> Optional[Tuple[int, float]]:
    """(peer, silence) of the loss client 0 wrote into its heartbeat, or None."""
    try:
        lost = json.loads(content or "").get("lost")
        return (int(lost["peer"]), float(lost["silent_s"])) if lost else None
    except (ValueError, AttributeError, KeyError, TypeError):
        return None
