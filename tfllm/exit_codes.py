"""The exit codes of tfllm's commands, and which failures map to them.

A contract with schedulers, scripts and `tfllm launch`, kept on the ground floor so that
every layer (the CLI, training, the watchdog, the launcher) names the same numbers:

====  =======================  ==========================================================
code  name                     meaning
====  =======================  ==========================================================
2     BAD_INPUT_EXIT_CODE      fix the input, nothing was written; never worth a retry
3     NONFINITE_EXIT_CODE      the loss or gradient norm became NaN/Inf (on_nonfinite=abort)
74    IO_ERROR_EXIT_CODE       the storage failed (a full disk, a quota, a read-only or
                               failing disk, a path that may not be written); the latest
                               committed checkpoint stays intact, so the same command
                               resumes once the storage is fixed
75    PREEMPTED_EXIT_CODE      stopped by a signal after saving: run it again to resume
76    PEER_LOST_EXIT_CODE      another client of a multi-client job stopped responding
124   STARTUP_TIMEOUT_EXIT_CODE  `tfllm launch`: no worker became ready in time
130   HARD_STOP_EXIT_CODE      a second signal (or Ctrl-C outside training): stopped at
                               once, nothing saved
====  =======================  ==========================================================
"""

from __future__ import annotations

import errno
import os
from typing import Optional

#: bad input (an argument, config, data, tokenizer, checkpoint, workdir); nothing written
BAD_INPUT_EXIT_CODE = 2
#: the loss or gradient norm became NaN/Inf under train.on_nonfinite=abort
NONFINITE_EXIT_CODE = 3
#: the storage failed or refused a write (sysexits' EX_IOERR); committed files are intact
IO_ERROR_EXIT_CODE = 74
#: stopped by a signal after saving (sysexits' EX_TEMPFAIL: "try again")
PREEMPTED_EXIT_CODE = 75
#: a peer of a multi-client job stopped responding (tfllm.parallel.watchdog)
PEER_LOST_EXIT_CODE = 76
#: `tfllm launch`: no worker became ready within --startup-timeout (as timeout(1))
STARTUP_TIMEOUT_EXIT_CODE = 124
#: a second signal, or Ctrl-C outside training: stopped at once, nothing saved (128+SIGINT)
HARD_STOP_EXIT_CODE = 130

#: errno values that mean the storage failed, whatever was being done
_STORAGE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None),
                                        errno.EIO, errno.EROFS, errno.EFBIG) if e is not None)
_PERMISSION_ERRNOS = frozenset((errno.EACCES, errno.EPERM))


class InputError(ValueError):
    """Bad input to a command; the message names the input and the fix (exit 2)."""


def io_failure(error: Optional[BaseException]) -> Optional[OSError]:
    """The OSError behind `error` when the storage failed or refused a write, else None.

    Looks at `error` and its causes (`raise ... from`, and the implicit context unless it
    was suppressed), so that a checkpoint error raised from a full disk counts. Permission
    denied on an existing file that cannot be read is an unreadable input (bad input), not
    a failed write.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            if error.errno in _STORAGE_ERRNOS:
                return error
            if error.errno in _PERMISSION_ERRNOS and not _unreadable(error.filename):
                return error
        error = error.__cause__ if error.__cause__ is not None else (
            None if error.__suppress_context__ else error.__context__)
    return None


def _unreadable(path) -> bool:
    """Whether `path` is an existing file this process may not read (an input's error)."""
    return (isinstance(path, (str, bytes, os.PathLike)) and os.path.isfile(path)
            and not os.access(path, os.R_OK))
