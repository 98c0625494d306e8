"""Sharded, atomic checkpoints of the whole run state; restore onto any mesh.

See `storage` for the on-disk layout and commit protocol, `shards` for how shards map
between layouts, `reader` for verification (checksums catch corruption, not tampering;
every name read is confined to the checkpoint), `signing` for the optional HMAC that
does catch tampering, `checkpointer` for the API a training loop uses, `state` for the
names of the run-state variables, and `workdir` for the run directory that holds a run's
checkpoints (imported on its own: `tfllm.checkpoint.workdir.Workdir`).
"""

from tfllm.checkpoint.checkpointer import Checkpointer, agree_nonce
from tfllm.checkpoint.reader import Reader, verify
from tfllm.checkpoint.shards import CheckpointError
from tfllm.checkpoint.state import model_variables, run_state_variables, state_name
from tfllm.checkpoint.storage import cleanup, committed, latest, prune

__all__ = ["Checkpointer", "CheckpointError", "Reader", "agree_nonce", "cleanup", "committed",
           "latest", "model_variables", "prune", "run_state_variables", "state_name", "verify"]
