"""The run a workdir holds: its config, and the run restored for inference.

What `tfllm generate`, `eval`, `export` and a resumed `tfllm train` need of a workdir,
and a notebook too: which config the run holds (`run_config`, `saved_config`,
`config_for`), and the run with its latest checkpoint's weights (`restored_run`).

The config is read without TensorFlow: from WORKDIR/config.yaml, or, when that was
deleted, from the newest committed checkpoint (whose reader imports TensorFlow, so
only then); a folder that is no run is refused before TensorFlow is imported.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

from tfllm.config import load_config
from tfllm.runpaths import RunPaths


def run_config(workdir: str, overrides: Sequence[str] = ()):
    """The config of the run in `workdir`, with `overrides` (`--set`): its config.yaml,
    else (deleted) the config saved in its newest committed checkpoint; None without
    either."""
    paths = RunPaths(workdir)
    if os.path.exists(paths.config_file):
        return load_config(paths.config_file, overrides)
    if not os.path.isdir(paths.checkpoints):
        return None  # no checkpoint to hold a config; refused without importing TensorFlow
    # The checkpoint's reader imports TensorFlow: only for a run whose config.yaml is gone.
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.config.loader import config_from_dict
    run_dir = Workdir(workdir)
    data = run_dir.saved_config()
    if data is None:
        return None
    return config_from_dict(data, overrides, run_dir.checkpoints)


def saved_config(workdir: str, overrides: Sequence[str] = ()):
    """The config of the run in `workdir` (`run_config`), which must exist.

    Raises:
      FileNotFoundError: the folder holds no run (no config.yaml, no checkpoint with a
        config).
    """
    config = run_config(workdir, overrides)
    if config is None:
        raise FileNotFoundError(f"{RunPaths(workdir).config_file} does not exist "
                                "and no checkpoint there holds a config; --workdir must name "
                                "a directory written by tfllm train.")
    return config


def config_for(workdir: str, config_file: Optional[str] = None,
               overrides: Sequence[str] = ()):
    """The config a run in `workdir` trains with: `config_file` and `overrides`; without
    a file, the workdir's own run's config (a resume), else the defaults."""
    config = run_config(workdir, overrides) if config_file is None else None
    return config if config is not None else load_config(config_file, overrides)


def require_checkpoint(workdir: str) -> None:
    """Raises `FileNotFoundError` unless `workdir` holds a committed checkpoint (checked
    before anything is built or written)."""
    from tfllm.checkpoint.workdir import Workdir  # the checkpoint reader: TensorFlow
    run_dir = Workdir(workdir)
    if not run_dir.committed():
        raise FileNotFoundError(f"{run_dir.checkpoints} holds no committed checkpoint; "
                                "train first (tfllm train --workdir ...).")


def restored_run(workdir: str, config) -> Tuple[object, dict]:
    """The run in `workdir` with its latest checkpoint's weights, for inference (any
    mesh: `config`'s), and that checkpoint's metadata.

    The weights alone (the inference `Run` has no optimizer state to fill), after the
    tokenizer was checked against the fingerprint the checkpoint holds: another one in
    WORKDIR/tokenizer would turn them into nonsense without a word.

    Args:
      workdir: a run directory holding a committed checkpoint (`require_checkpoint`).
      config: its config (`saved_config`), with any --set overrides.

    Returns:
      (a `tfllm.train.run.Run` built with `inference=True`, the checkpoint's metadata).
    """
    from tfllm.checkpoint.workdir import Workdir, WorkdirState, check_tokenizer
    from tfllm.train.run import Run  # builds the mesh: after the command's settings
    run_dir = Workdir(workdir)
    run = Run(config, workdir=workdir, train_iterator=False, inference=True)
    check_tokenizer(WorkdirState(workdir, *run_dir.newest_metadata()), run.tokenizer)
    meta = run_dir.restore_weights(run.model, run.parallel, config.checkpoint)
    if run.reference is not None:  # DPO's reference copy (full fine-tuning) for `eval`
        # saved with the run; an import (step 0) is its own reference
        imported = meta.get("step") == 0 and "imported" in meta
        run_dir.restore_weights(run.reference, run.parallel, config.checkpoint,
                                step=meta["step"], fp8_state=False,
                                prefix="model" if imported else "reference")
    c = config
    if c.train.objective == "dpo" and c.dpo.precompute_reference and c.dpo.loss != "orpo":
        # the held-out pairs' stored reference log-probs (the model has moved since)
        from tfllm.data.sources import has_validation  # tf.data: after the CLI's checks
        from tfllm.train import reference
        if has_validation(c.data):
            stored = reference.load(workdir, {"validation":
                                              run.feed.pair_batches("validation")})
            run.feed.references = dict(stored.tables)
    return run, meta
