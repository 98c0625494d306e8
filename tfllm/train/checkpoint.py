"""Checkpoints for the training loop: the implementation lives in `tfllm.checkpoint`."""

from tfllm.checkpoint import (Checkpointer, CheckpointError, run_state_variables,  # noqa: F401
                              latest, cleanup)
