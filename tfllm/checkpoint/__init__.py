"""Sharded, atomic checkpoints of the whole run state; restore onto any mesh.

See `storage` for the on-disk layout and commit protocol, `shards` for how shards map
between layouts, `reader` for verification (checksums catch corruption, not tampering;
every name read is confined to the checkpoint), `signing` for the optional HMAC that
does catch tampering, and `checkpointer` for the API a training loop uses.
"""

from tfllm.checkpoint.checkpointer import Checkpointer, agree_nonce
from tfllm.checkpoint.reader import Reader, verify
from tfllm.checkpoint.shards import CheckpointError
from tfllm.checkpoint.state import run_state_variables
from tfllm.checkpoint.storage import cleanup, committed, latest, prune

__all__ = ["Checkpointer", "CheckpointError", "Reader", "agree_nonce", "cleanup", "committed",
           "latest", "prune", "run_state_variables", "verify"]
