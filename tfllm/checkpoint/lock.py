"""One writer per run: the `tfllm train` writing a workdir holds a lock there.

Each client of a run holds `WORKDIR/.tfllm-locks/client_N.lock` from before it writes
anything until it exits: an advisory `flock` on the open (empty) file, which the kernel
releases when the process ends however it ends (a kill -9 included), so a lock is never
stale. Beside it, `client_N.holder` keeps the holder's pid, host and start time while it
holds the lock (removed when it lets go), so a second `tfllm train` on the same run is
refused naming the live process, and a run that finds the record of a process that died
holding the lock says whose it was. A run that is refused after taking the lock (a
checkpoint that fails its checks) leaves the folder as it found it. Readers (`tfllm generate`, `eval`, `export`) take no lock:
they read committed checkpoints only, which a writer never changes.

One writer per checkpoint folder, too: `checkpoints/` may be a link (to another disk),
so two workdirs could reach one folder. Client 0 (which removes interrupted saves,
commits and prunes) also holds a `flock` on the real (resolved) checkpoint folder itself,
and while it holds it `.tfllm-writer` there names it (pid, host, start, workdir): a second
run reaching that folder by any path is refused naming the run that writes it, before it
removes, restores or prunes anything there. The record goes when the lock is let go.

flock is per host: on a network filesystem shared by several hosts (NFS), two hosts may
each hold "the" lock; the checkpoint's own commit protocol still keeps every checkpoint
whole.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from typing import Optional

from tfllm import files
from tfllm.confined import read_regular
from tfllm.checkpoint.workdir import WorkdirError
from tfllm.contracts import WRITER_RECORD
from tfllm.runpaths import RunPaths


class RunLock:
    """The lock of client `client` on `workdir` (a context manager; see the module).

    Attributes:
      previous: the holder a dead process left in the file when this lock was taken
        ({"pid", "host", "started"}), or None.
    """

    def __init__(self, workdir: str, client: int = 0):
        self.workdir = workdir
        paths = RunPaths(workdir)
        self.directory = paths.locks_dir
        self.path, self.holder = paths.lock(client), paths.lock_holder(client)
        self.checkpoints, self.client = paths.checkpoints, client
        self.previous: Optional[dict] = None
        self._file = None
        self._folder = None  # (descriptor, real path) of the checkpoint folder held

    def acquire(self) -> "RunLock":
        """Takes the lock; `WorkdirError` (exit 2) naming the live holder when another
        process has it."""
        if os.path.islink(self.directory) or (os.path.lexists(self.directory)
                                              and not os.path.isdir(self.directory)):
            raise WorkdirError(f"{self.directory} is not a folder tfllm made; remove it "
                               "(it only ever holds tfllm's lock files).")
        # created when missing, never truncated (its holder may be writing it), no link
        lock = files.open_for_writing(self.workdir, self.path, "ab", append=True)
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(self.holder)
            lock.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
                   f"{holder.get('started')}" if holder else "another process")
            raise WorkdirError(
                f"--workdir {os.path.dirname(self.directory)}: a tfllm train ({who}) is "
                "writing this run; wait for it to end, or stop it (Ctrl-C or kill -TERM "
                "saves and exits 75), then run this again.") from None
        self._file = lock
        old = _read(self.holder)  # left only by a holder that died
        if old and (old.get("pid"), old.get("host")) != (os.getpid(), socket.gethostname()):
            self.previous = old
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        files.write_atomically(self.workdir, self.holder, json.dumps(record),
                               suffix=f".{os.getpid()}.part")
        if os.path.lexists(self.checkpoints):  # a resumed run's: held before it is touched
            try:
                self.hold_checkpoints()
            except BaseException:
                self.release()
                raise
        return self

    def hold_checkpoints(self) -> None:
        """Client 0: locks the real checkpoint folder (made when missing), whatever path
        leads to it; `WorkdirError` (exit 2) naming the run that writes it when another
        process holds it. Other clients, and a second call, do nothing."""
        if self.client != 0 or self._folder is not None:
            return
        if os.path.lexists(self.checkpoints) and not os.path.isdir(self.checkpoints):
            raise WorkdirError(f"--workdir {self.workdir}: {self.checkpoints} is not a folder "
                               "(a file, or a link to nothing); remove it or make it the "
                               "folder the run's checkpoints go to.")
        files.make_dirs(self.checkpoints)  # the folder itself may be a link: the user's
        real = os.path.realpath(self.checkpoints)
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        record_path = os.path.join(real, WRITER_RECORD)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return  # a filesystem without flock on folders: the workdir lock remains
            holder = _read(record_path)
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
                   f"{holder.get('started')}, --workdir {holder.get('workdir')}"
                   if holder else "another process")
            link = (f" (its checkpoints/ leads to {real})"
                    if real != os.path.abspath(self.checkpoints) else "")
            raise WorkdirError(
                f"--workdir {self.workdir}: the checkpoint folder {real}{link} is written "
                f"by a tfllm train ({who}); two runs never share one: give this run its "
                "own checkpoints/ (remove the link), or wait for that run to end.") from None
        self._folder = (fd, real)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "workdir": os.path.abspath(self.workdir)}
        files.write_atomically(real, record_path, json.dumps(record),
                               suffix=f".{os.getpid()}.part")

    def release(self) -> None:
        """Lets the lock go (the file stays: removing it could race a waiting run)."""
        if self._folder is not None:
            fd, real = self._folder
            self._folder = None
            try:
                record = os.path.join(real, WRITER_RECORD)
                if _read(record).get("pid") == os.getpid():  # this holder's own record
                    files.remove(real, record)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        if self._file is not None:
            try:
                if os.path.isfile(self.holder) and not os.path.islink(self.holder):
                    files.remove(self.workdir, self.holder)  # this holder's own record
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            finally:
                self._file.close()
                self._file = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(path: str) -> dict:
    """A holder record, or {} (missing, unreadable, not a small regular file)."""
    try:
        if os.path.islink(path):
            return {}
        record = json.loads(read_regular(path, 4096, "a lock's holder record"))
    except (OSError, ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}
