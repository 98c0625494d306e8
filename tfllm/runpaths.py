"""Every path of a run's workdir, joined here and nowhere else (ground floor, no TensorFlow).

`tfllm.contracts` names what a run keeps in its workdir; `RunPaths` joins those names
into paths, the per-client ones included (a client's log, heartbeat, XLA compile cache,
profile traces and lock), so that the checkpointer's `Workdir`, the CLI, the watchdog,
the runtime environment, the tokenizer and the launcher ask one owner instead of each
joining its own (tests/test_layers.py holds every other module to it). Reading a path
here starts nothing: the CLI resolves a run's config and the launcher its log folder
without importing TensorFlow.
"""

from __future__ import annotations

import os

from tfllm.contracts import (CHAT_TEMPLATE_FILE, CHECKPOINTS_DIR, CONFIG_FILE, COSTS_FILE,
                             EVAL_DIR, LOCKS_DIR, LOGS_DIR,
                             MARKER, REFERENCE_FILE, METRICS_FILE, PLOT_FILE,
                             PRETRAINED_FILE,
                             TENSORBOARD_DIR, TOKENIZER_DIR, TOKENIZER_MODEL_FILE,
                             TRACKERS_FILE, WANDB_DIR, XLA_CACHE_DIR)

#: the name of a client's folder (XLA cache, traces) or file (log, lock) in a workdir
CLIENT = "client_{}"
#: a client's heartbeat in WORKDIR/logs (`tfllm.runtime.watchdog`)
HEARTBEAT = "heartbeat.{}"
#: the suffixes of a client's lock file and of its holder record in WORKDIR/.tfllm-locks
LOCK_SUFFIX, HOLDER_SUFFIX = ".lock", ".holder"


class RunPaths:
    """The paths of what a run keeps in its workdir (none need exist).

    Args:
      path: the run directory (an export's folder, for its config.yaml and tokenizer/).
    """

    def __init__(self, path: str):
        self.path = path

    def entry(self, name: str) -> str:
        """WORKDIR/NAME: a top-level entry found by listing the workdir."""
        return os.path.join(self.path, name)

    # ---- what a run writes -----------------------------------------------------------------
    @property
    def checkpoints(self) -> str:
        """WORKDIR/checkpoints: the committed checkpoints (`tfllm.checkpoint.storage`)."""
        return self.entry(CHECKPOINTS_DIR)

    @property
    def config_file(self) -> str:
        """WORKDIR/config.yaml: the resolved config (written after the checkpoint is read)."""
        return self.entry(CONFIG_FILE)

    @property
    def metrics_file(self) -> str:
        return self.entry(METRICS_FILE)

    @property
    def tensorboard_dir(self) -> str:
        return self.entry(TENSORBOARD_DIR)

    @property
    def plot_file(self) -> str:
        return self.entry(PLOT_FILE)

    @property
    def costs_file(self) -> str:
        return self.entry(COSTS_FILE)

    @property
    def trackers_file(self) -> str:
        """WORKDIR/trackers.json: the ids of the run's tracker runs (`tfllm.train.trackers`)."""
        return self.entry(TRACKERS_FILE)

    @property
    def wandb_dir(self) -> str:
        """WORKDIR/wandb: W&B's local runs (offline ones until `wandb sync`), when WANDB_DIR
        is not set."""
        return self.entry(WANDB_DIR)

    @property
    def tokenizer_dir(self) -> str:
        return self.entry(TOKENIZER_DIR)

    @property
    def tokenizer_model_file(self) -> str:
        """WORKDIR/tokenizer/tokenizer.model: a run's trained SentencePiece model."""
        return os.path.join(self.tokenizer_dir, TOKENIZER_MODEL_FILE)

    @property
    def chat_template_file(self) -> str:
        """WORKDIR/chat_template.jinja: the run's copy of data.chat_template."""
        return self.entry(CHAT_TEMPLATE_FILE)

    @property
    def eval_dir(self) -> str:
        """WORKDIR/eval: `tfllm eval --tasks`' results (lm-eval's results JSON, samples)."""
        return self.entry(EVAL_DIR)

    @property
    def reference_file(self) -> str:
        """WORKDIR/reference_logps.json: DPO's precomputed reference log-probabilities
        (dpo.precompute_reference)."""
        return self.entry(REFERENCE_FILE)

    @property
    def pretrained_file(self) -> str:
        return self.entry(PRETRAINED_FILE)

    @property
    def marker_file(self) -> str:
        return self.entry(MARKER)

    # ---- shared folders, and each client's place in them -----------------------------------
    @property
    def logs_dir(self) -> str:
        """WORKDIR/logs: `tfllm launch`'s default log folder, the clients' logs and the
        watchdog's heartbeats."""
        return self.entry(LOGS_DIR)

    @property
    def locks_dir(self) -> str:
        """WORKDIR/.tfllm-locks: one lock per client (`tfllm.checkpoint.lock`)."""
        return self.entry(LOCKS_DIR)

    def client_log(self, client: int) -> str:
        """WORKDIR/logs/client_N.log: where a client other than 0 prints."""
        return os.path.join(self.logs_dir, CLIENT.format(client) + ".log")

    def heartbeat(self, client: int) -> str:
        """WORKDIR/logs/heartbeat.N (`tfllm.runtime.watchdog`)."""
        return os.path.join(self.logs_dir, HEARTBEAT.format(client))

    def xla_cache(self, client: int) -> str:
        """WORKDIR/xla_cache/client_N: a client's persistent XLA cache
        (`train.xla_cache=auto`)."""
        return os.path.join(self.entry(XLA_CACHE_DIR), CLIENT.format(client))

    def traces(self, client: int) -> str:
        """Where a client's profile traces go (TensorBoard's log directory for them):
        WORKDIR/tensorboard for client 0, WORKDIR/tensorboard/client_N for the others."""
        return (self.tensorboard_dir if client == 0
                else os.path.join(self.tensorboard_dir, CLIENT.format(client)))

    def lock(self, client: int) -> str:
        """WORKDIR/.tfllm-locks/client_N.lock."""
        return os.path.join(self.locks_dir, CLIENT.format(client) + LOCK_SUFFIX)

    def lock_holder(self, client: int) -> str:
        """WORKDIR/.tfllm-locks/client_N.holder: who holds the client's lock."""
        return os.path.join(self.locks_dir, CLIENT.format(client) + HOLDER_SUFFIX)


#: a rank's files in the launcher's log folder (`tfllm launch --log-dir`, default
#: WORKDIR/logs): its output, its readiness file and its recorded exit
RANK_LOG, READY, EXIT_RECORD = "rank_{}.log", "ready.{}", "exit.{}"
#: the process ids the launcher started, in its log folder
PIDS = "pids"
#: a rank's report in `tfllm doctor --report-dir DIR`
DOCTOR_REPORT = "doctor.rank_{}.json"


class LaunchLogs:
    """The paths of what `tfllm launch` keeps in its log folder (none need exist).

    Args:
      path: the log folder (`--log-dir`, shared by the job's hosts where it spans several).
    """

    def __init__(self, path: str):
        self.path = path

    def rank_log(self, rank: int) -> str:
        """LOG_DIR/rank_N.log: rank N's output, every attempt appended."""
        return os.path.join(self.path, RANK_LOG.format(rank))

    def ready(self, rank: int) -> str:
        """LOG_DIR/ready.N: created by rank N's worker once its mesh is up."""
        return os.path.join(self.path, READY.format(rank))

    def exit_record(self, rank: int) -> str:
        """LOG_DIR/exit.N: rank N's key, exit code and whether it was signalled."""
        return os.path.join(self.path, EXIT_RECORD.format(rank))

    @property
    def pids(self) -> str:
        """LOG_DIR/pids: the process groups the launcher started on this host."""
        return os.path.join(self.path, PIDS)
