"""A quiet start: TensorFlow's C++ start-up logs kept off the terminal unless asked for.

TensorFlow 2.21 writes its start-up records (oneDNN, CUDA stubs and cuInit on machines
without a GPU, "All log messages before absl::InitializeLog() ...") straight to file
descriptor 2 before its own log level is read, so TF_CPP_MIN_LOG_LEVEL alone does not
silence them. The `tfllm` command therefore routes descriptor 2 through a filter that
drops C++ log records below the level the user asked for (TF_CPP_MIN_LOG_LEVEL when it
was set before tfllm started, else 2: errors only) and the known start-up noise; every
other line (tracebacks, tfllm's messages, Python warnings) passes unchanged.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
from typing import Optional

# A glog/absl record: level letter, MMDD, time (before absl is initialized its seconds
# field is the epoch: "I0000 00:00:1795338973.266483"), thread id, file:line].
_RECORD = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] ")
_LEVELS = {"I": 0, "W": 1, "E": 2, "F": 3}
# A SentencePiece record (its own logger, at each model load): "normalizer.cc(51) LOG(INFO) ".
_SENTENCEPIECE = re.compile(r"^\S+\.cc\(\d+\) LOG\((INFO|WARNING|ERROR|FATAL)\) ")
# Start-up lines that are noise whatever their level (no GPU here, absl not initialized).
_NOISE = re.compile(r"absl::InitializeLog\(\) is called|failed call to cuInit|"
                    r"^To enable the following instructions: .*compiler flags\.$")


def is_noise(line: str, min_level: int) -> bool:
    """Whether `line` is a C++ start-up record the user did not ask to see.

    Args:
      line: one line of descriptor 2, without its newline.
      min_level: TF_CPP_MIN_LOG_LEVEL: 0 shows everything, 1 hides info, 2 warnings,
        3 errors too.
    """
    if min_level <= 0:
        return False
    match = _RECORD.match(line) or _SENTENCEPIECE.match(line)
    if match:
        level = _LEVELS[match.group(1)[0]]
        return level < min_level or bool(_NOISE.search(line))
    return bool(_NOISE.search(line))


_restore = None


def release() -> None:
    """Puts descriptor 2 back and waits until the filter has passed on everything written
    so far. Call before `os._exit`, which skips the exit handler that would do it."""
    if _restore is not None:
        _restore()


def install(user_level: Optional[str]) -> None:
    """Filters descriptor 2 for the rest of the process (the `tfllm` command calls this).

    Args:
      user_level: TF_CPP_MIN_LOG_LEVEL as the user set it before tfllm started, or None
        (then 2: errors only, and the start-up noise dropped).
    """
    try:
        min_level = int(user_level) if user_level is not None else 2
    except ValueError:
        min_level = 2
    if min_level <= 0:
        return
    read_fd, write_fd = os.pipe()
    original = os.dup(2)
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    out = os.fdopen(original, "wb", buffering=0)

    def pump() -> None:
        with os.fdopen(read_fd, "rb") as source:
            for raw in source:
                if not is_noise(raw.decode("utf-8", "replace").rstrip("\n"), min_level):
                    out.write(raw)

    thread = threading.Thread(target=pump, name="tfllm-stderr-filter", daemon=True)
    thread.start()

    def restore() -> None:
        # Closing the pipe's only write end (descriptor 2) ends the pump after it has
        # passed on everything written so far, tracebacks included.
        global _restore
        if _restore is None:
            return
        _restore = None
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        try:
            os.dup2(original, 2)
        except OSError:
            return
        thread.join(timeout=5)

    global _restore
    _restore = restore
    atexit.register(restore)
