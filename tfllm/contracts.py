"""The contracts every layer of tfllm shares, on the ground floor (imports nothing of tfllm).

Four agreements with the world outside one Python module, each owned here so that the
CLI, training, the checkpointer, the watchdog and the launcher name the same things:

* **The run directory's names** (`MARKER`, `CHECKPOINTS_DIR`, ..., `LOGS_DIR`): what a
  run, `tfllm launch` (logs, heartbeats) and the tokenizer keep in a workdir.
  `tfllm.runpaths.RunPaths` joins them into paths (and nothing else does).

* **Client identity**: which process of a multi-client job this is (`client_id`,
  `num_clients`), read from DTensor's own environment (`DTENSOR_CLIENT_ID`, and the
  entries of `DTENSOR_JOBS`).
* **The readiness handshake** between `tfllm launch` and its workers: a worker whose mesh
  is up creates `TFLLM_READY_FILE` and prints `READY_LINE` with `TFLLM_READY_KEY`
  (`tfllm.runtime.coordination.announce_ready`); the launcher waits for one of them.
* **Exit codes**, a contract with schedulers, scripts and `tfllm launch`, and which
  failures map to them:

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
#: a peer of a multi-client job stopped responding (tfllm.runtime.watchdog)
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


def num_clients() -> int:
    """Clients of a DTensor multi-client job: the entries of DTENSOR_JOBS (else 1)."""
    jobs = os.environ.get("DTENSOR_JOBS", "")
    return len([j for j in jobs.split(",") if j]) or 1


def client_id() -> int:
    """This process's index in a DTensor multi-client job (DTENSOR_CLIENT_ID, else 0)."""
    return int(os.environ.get("DTENSOR_CLIENT_ID", "0") or 0)


#: the marker a run (or an import) writes first: the workdir is tfllm's
MARKER = ".tfllm-run"
#: the names of what a run keeps in its workdir (`tfllm.runpaths.RunPaths` joins them)
CHECKPOINTS_DIR = "checkpoints"
#: the resolved config, in a run directory and in an export (`tfllm.config.loader` writes it)
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "loss.png"
#: the cost report of the step (`tfllm.compiler.costs.CostReport.as_dict()`), after step one
COSTS_FILE = "costs.json"
#: the run's tokenizer: a keras-hub preset folder, or a SentencePiece model in it
TOKENIZER_DIR = "tokenizer"
TOKENIZER_MODEL_FILE = "tokenizer.model"
#: where an imported run's weights came from (`tfllm.pretrained.importer`)
PRETRAINED_FILE = "pretrained.json"
#: the run's copy of data.chat_template, read as it starts (`tfllm.data.chat_template`)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: the tracker runs of `tracking.loggers` (their ids and stores), written as they start and
#: read back on resume to continue them (`tfllm.train.trackers`)
TRACKERS_FILE = "trackers.json"
#: Weights & Biases' own folder of local runs (without WANDB_DIR): never cleared by tfllm
WANDB_DIR = "wandb"
#: `tfllm eval --tasks`: lm-eval's results JSON and samples (`tfllm.evals.benchmark`)
EVAL_DIR = "eval"
#: DPO's precomputed reference log-probabilities (dpo.precompute_reference,
#: `tfllm.train.reference`), written before the first step and read back on resume
REFERENCE_FILE = "reference_logps.json"
#: `tfllm launch`'s client logs and the watchdog's heartbeats
LOGS_DIR = "logs"
#: the persistent XLA compile cache of `train.xla_cache=auto`, one folder per client
XLA_CACHE_DIR = "xla_cache"
#: one lock file per client, held by the `tfllm train` writing the run
#: (`tfllm.checkpoint.lock`): one writer per run
LOCKS_DIR = ".tfllm-locks"
#: who writes a checkpoint folder (pid, host, start, workdir), kept in the real folder
#: while client 0 of a `tfllm train` holds it (`tfllm.checkpoint.lock`)
WRITER_RECORD = ".tfllm-writer"
#: the files and folders a run writes: cleared when a dead run without checkpoints is
#: reused (`tfllm.checkpoint.workdir`), the only top-level names tfllm deletes in a run
RUN_OUTPUTS = (METRICS_FILE, TENSORBOARD_DIR, PLOT_FILE, CONFIG_FILE, COSTS_FILE,
               TOKENIZER_DIR, PRETRAINED_FILE, CHAT_TEMPLATE_FILE, TRACKERS_FILE,
               REFERENCE_FILE)


#: the variables `tfllm launch` gives a worker for the readiness handshake
READY_FILE_ENV, READY_KEY_ENV = "TFLLM_READY_FILE", "TFLLM_READY_KEY"
#: the line a worker prints once its mesh is up when given TFLLM_READY_KEY
READY_LINE = "tfllm: ready {}"
