"""The run directory: what a run writes there and when it may reuse one.

A workdir "holds a run" once it has a committed checkpoint. Starting in such a workdir
resumes that run, which is only allowed when the settings that define the run (model,
data, optimizer, precision, batch and seed) are unchanged; the mesh, the number of
steps, logging, evaluation and checkpoint cadence may change between resumes. A workdir
whose earlier run died before its first checkpoint holds nothing to resume: its own
files (metrics, TensorBoard, plot) are cleared and the run starts afresh.
"""

from __future__ import annotations

import json
import os
import shutil

import yaml

from tfllm.config.loader import ConfigError, to_dict

#: (section, key or None for the whole section) that define a run and must not change.
RUN_DEFINING = (("model", None), ("data", None), ("optimizer", None),
                ("precision", None), ("train", "global_batch_size"),
                ("train", "grad_accum_steps"), ("train", "seed"))

#: the cost report of the step (`tfllm.train.costs.CostReport.as_dict()`), after step one
COSTS_FILE = "costs.json"

#: files and folders a run writes; cleared when a dead run without checkpoints is reused
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "loss.png", "config.yaml", COSTS_FILE)


class WorkdirError(ConfigError):
    """The workdir cannot be used for this run."""


def _differences(saved: dict, current: dict, defining=RUN_DEFINING) -> list:
    diffs = []
    for section, key in defining:
        keys = [key] if key else sorted(set(saved.get(section, {})) | set(current[section]))
        for k in keys:
            a, b = saved.get(section, {}).get(k), current[section].get(k)
            if a != b:
                diffs.append(f"{section}.{k}: {a!r} there, {b!r} now")
    return diffs


def imported_start(checkpoint_dir: str) -> bool:
    """Whether the newest committed checkpoint is a `tfllm import` (pretrained weights at
    step 0): training from it starts a new (fine-tuning) run rather than resuming one."""
    from tfllm.checkpoint import Reader, committed
    steps = committed(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    if not steps or steps[-1][0] != 0:
        return False
    return "imported" in Reader(steps[-1][1]).metadata()


def check_workdir(workdir: str, config, has_checkpoint: bool, imported: bool = False) -> None:
    """Raises `WorkdirError` when `workdir` holds a different run.

    Args:
      workdir: the run directory.
      config: this run's validated config.
      has_checkpoint: whether the workdir has a committed checkpoint.
      imported: the checkpoint is pretrained weights (`tfllm import`): only the model
        section must match; data, optimizer, precision and batch are the new run's.
    """
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"--workdir {workdir} is a file, not a directory; choose another "
                           "path.")
    path = os.path.join(workdir, "config.yaml")
    if not has_checkpoint or not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            saved = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise WorkdirError(f"{path} cannot be read ({e}); restore it or use a new "
                           "--workdir.") from None
    diffs = _differences(saved, to_dict(config), (("model", None),) if imported
                         else RUN_DEFINING)
    if diffs:
        raise WorkdirError(
            f"{workdir} holds a different run ({'; '.join(diffs[:4])}"
            f"{'; ...' if len(diffs) > 4 else ''}). Use a new --workdir, or start that run's "
            f"settings again (tfllm train --config {path} --workdir {workdir}) to resume it.")


def clear_dead_run(workdir: str) -> None:
    """Removes the outputs of an earlier run that never committed a checkpoint."""
    for name in RUN_OUTPUTS:
        path = os.path.join(workdir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def truncate_metrics(path: str, last_step: int) -> None:
    """Drops metrics.jsonl records after `last_step` (they are recomputed on resume)."""
    if not os.path.exists(path):
        return
    from tfllm.train.plots import read_metrics
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, path)


def write_costs(workdir: str, costs: dict) -> str:
    """Writes the step's cost report as WORKDIR/costs.json (whole or not at all); returns
    the path."""
    from tfllm.checkpoint.storage import write_json_atomic
    path = os.path.join(workdir, COSTS_FILE)
    write_json_atomic(path, costs)
    return path
