"""The run directory (workdir): its saved run and its rules.

`Workdir` is the run's paths (`tfllm.runpaths.RunPaths`, the one owner of every path of a
workdir, on the ground floor: checkpoints/, config.yaml, metrics.jsonl, tensorboard/,
loss.png, costs.json, tokenizer/, pretrained.json, logs/, the `.tfllm-run` marker and the
per-client ones) with what a run saved there. It reads what the run
saved (the newest committed checkpoint's metadata and config), makes the run's
`Checkpointer` on WORKDIR/checkpoints, and restores a model's weights alone (no optimizer
state) from the latest committed checkpoint or a given step, for `tfllm generate`, `eval`
and the exports. The module's functions hold the rules of when a run may start there.

A workdir "holds a run" once it has a committed checkpoint. Starting in such a workdir
resumes that run, which is only allowed when the settings that define the run (model,
data, optimizer, precision, batch and seed) equal those saved in the checkpoint itself
(not only in config.yaml, which anyone may edit or delete) and the tokenizer is the one
it trained with (its fingerprint is saved in every checkpoint); the mesh, the number of
steps, logging, evaluation and checkpoint cadence may change between resumes.

tfllm never deletes a file it did not write. Once its input is checked, every run writes
a marker, `.tfllm-run` (a small JSON file: who started the run, where and when), before
any other file. A workdir without a checkpoint
is used only when it is empty, or holds nothing but a dead tfllm run: the marker and
tfllm's own outputs (metrics, TensorBoard, plot, config, tokenizer, cost report, leftovers
of their atomic writes). Those outputs are cleared and the run starts afresh. Anything
else, or tfllm-named files without the marker, is refused with one line naming it. The
`logs/` and `xla_cache/` folders (written by `tfllm launch` and the XLA cache before a
run starts) are allowed anywhere and never cleared.

It imports only the checkpoint package and the config (never `train`, `models` or
`pretrained`): every layer that touches a run directory can use it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import time
import uuid
from typing import Optional

from tfllm.checkpoint.checkpointer import Checkpointer
from tfllm.checkpoint.reader import Reader
from tfllm.checkpoint.shards import CheckpointError
from tfllm.checkpoint.state import model_variables
from tfllm.checkpoint.storage import committed, latest, step_name, write_json_atomic
from tfllm import files
from tfllm.confined import open_regular, read_regular
from tfllm.config.loader import ConfigError, read_config_file, save_config
from tfllm.contracts import (CHECKPOINTS_DIR, LOCKS_DIR, LOGS_DIR, MARKER, RUN_OUTPUTS,
                             WANDB_DIR, XLA_CACHE_DIR)
from tfllm.runpaths import RunPaths

#: (section, key or None for the whole section) that define a run and must not change.
RUN_DEFINING = (("model", None), ("data", None), ("optimizer", None),
                ("precision", None), ("train", "global_batch_size"),
                ("train", "grad_accum_steps"), ("train", "seed"))


#: tfllm's folders that are kept: checkpoints (the checkpointer removes interrupted saves
#: itself), and those written before a run starts (`tfllm launch`'s logs, heartbeats and
#: client logs; the XLA cache of `train.xla_cache=auto`), which may exist without a marker;
#: and W&B's local runs (`tracking.loggers`: offline ones wait there for `wandb sync`)
KEPT_DIRS = (CHECKPOINTS_DIR,)
SHARED_DIRS = (LOGS_DIR, XLA_CACHE_DIR, LOCKS_DIR, WANDB_DIR)

#: suffixes of tfllm's atomic writes (a temporary name, then a rename): config.yaml.tmp,
#: metrics.jsonl.tmp, costs.json.part, loss.png.tmp.png
_LEFTOVER_SUFFIXES = files.TEMPORARY_SUFFIXES


class Workdir(RunPaths):
    """A run directory: its saved run, on the paths `tfllm.runpaths.RunPaths` joins.

    Args:
      path: the run directory (need not exist yet).
    """

    def __repr__(self) -> str:
        return f"Workdir({self.path!r})"

    # ---- the saved run -------------------------------------------------------------------
    def committed(self) -> list:
        """(step, path) of every committed checkpoint, oldest first."""
        return committed(self.checkpoints)

    def latest_checkpoint(self) -> Optional[str]:
        """The newest committed checkpoint's path, or None."""
        return latest(self.checkpoints)

    def newest_metadata(self):
        """(path, metadata) of the newest committed checkpoint whose metadata can be read
        (corrupt ones are passed over: restoring decides what to do with them, per
        checkpoint.on_corruption), or (None, None) when there is none."""
        steps = self.committed()
        for _, path in reversed(steps):
            try:
                meta = Reader(path).metadata()
            except (CheckpointError, OSError, ValueError):
                continue
            if isinstance(meta, dict):
                return path, meta
        if steps:  # none readable: the restore reports the newest one's corruption
            return steps[-1][1], {}
        return None, None

    def saved_config(self) -> Optional[dict]:
        """The config (a nested dict) saved in the newest readable committed checkpoint,
        or None: what a resume without --config may use when config.yaml is gone
        (`tfllm.config.loader.config_from_dict`)."""
        _, meta = self.newest_metadata()
        config = (meta or {}).get("config")
        return config if isinstance(config, dict) else None

    def checkpointer(self, parallel=None, config=None) -> Checkpointer:
        """The run's `Checkpointer` on WORKDIR/checkpoints (created if missing).

        Args:
          parallel: the run's `tfllm.parallel.Parallel`, or None (one device).
          config: the run's `CheckpointConfig`, or None (defaults).
        """
        return Checkpointer(self.checkpoints, parallel, config)

    def restore_weights(self, model, parallel=None, config=None, step: Optional[int] = None,
                        fp8_state: bool = True, checkpointer: Optional[Checkpointer] = None,
                        new_adapters: bool = False, prefix: str = "model") -> dict:
        """Restores the model's variables alone (no optimizer state is needed or built)
        from the latest committed checkpoint (falling back past corrupt ones per
        config.on_corruption) or from `step`; returns that checkpoint's metadata.

        Args:
          model: a built Keras model, in the layouts of `parallel`.
          parallel: the model's `Parallel`, or None (one device).
          config: the run's `CheckpointConfig`, or None (defaults).
          step: a committed step, or None for the latest.
          fp8_state: restore the FP8 amax histories too (False for pretrained weights).
          checkpointer: the run's own `Checkpointer` (else one is made).
          new_adapters: LoRA weights (A and B) the checkpoint does not hold keep their
            initialization (adapters added to imported weights); others must be there.
          prefix: which saved model: "model", or "reference" (DPO's reference copy).

        Raises:
          FileNotFoundError: no committed checkpoint.
        """
        checkpointer = checkpointer or self.checkpointer(parallel, config)
        weights = model_variables(model, fp8_state, prefix)
        if new_adapters:
            found = step if step is not None else checkpointer.latest_step()
            if found is not None:
                saved = Reader(os.path.join(checkpointer.directory,
                                            step_name(found))).variables
                weights = {k: v for k, v in weights.items() if k in saved
                           or not k.endswith(("/lora_a", "/lora_b"))}
        if step is not None:
            return checkpointer.restore(weights, step, strict=False)
        meta = checkpointer.restore_latest(weights, strict=False)
        if meta is None:
            raise FileNotFoundError(f"{self.checkpoints} holds no committed checkpoint; "
                                    "train or import first.")
        return meta

    # ---- outputs -------------------------------------------------------------------------
    def save_config(self, config) -> str:
        """Writes the resolved config to WORKDIR/config.yaml; returns the path."""
        return save_config(config, self.path)

    def truncate_metrics(self, last_step: int) -> None:
        """Drops metrics.jsonl records after `last_step` (they are recomputed on resume)."""
        path = self.metrics_file
        if not os.path.exists(path):
            return
        keep = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
        files.write_atomically(self.path, path, "".join(json.dumps(r) + "\n" for r in keep))

    def write_costs(self, costs: dict) -> str:
        """Writes the step's cost report as WORKDIR/costs.json (whole or not at all);
        returns the path."""
        write_json_atomic(self.path, self.costs_file, costs)
        return self.costs_file


def read_metrics(path: str) -> list:
    """The records of a metrics.jsonl file (skipping a torn last line)."""
    records = []
    if not os.path.exists(path):
        return records
    # a regular file: a FIFO or a link to a device planted there would block or never end
    with open_regular(path, None, "metrics.jsonl", WorkdirError) as raw, \
            io.TextIOWrapper(raw, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash; the rest is still good
    return records


class WorkdirError(ConfigError):
    """The workdir cannot be used for this run."""


@dataclasses.dataclass
class WorkdirState:
    """What `check_workdir` found.

    Attributes:
      path: the workdir.
      checkpoint: the newest committed checkpoint whose metadata could be read, or None.
      metadata: that checkpoint's metadata ({"step", "config", "tokenizer", ...}) or None.
      imported: the checkpoint is pretrained weights of `tfllm import` (step 0): training
        starts a new (fine-tuning) run from it.
      dead_run: no checkpoint, and the workdir holds a dead tfllm run's outputs (cleared
        by `start_run`).
    """

    path: str
    checkpoint: Optional[str] = None
    metadata: Optional[dict] = None
    imported: bool = False
    dead_run: bool = False

    @property
    def has_checkpoint(self) -> bool:
        return self.checkpoint is not None

    @property
    def workdir(self) -> Workdir:
        return Workdir(self.path)


# ---- the marker ----------------------------------------------------------------------------
def read_marker(directory: str) -> Optional[dict]:
    """The marker of a tfllm run (or import) in `directory`, or None when there is none (an
    unreadable or foreign file counts as none)."""
    path = Workdir(directory).marker_file
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:  # a small regular file (the marker is ~200 bytes)
        marker = json.loads(read_regular(path, 1 << 16, "a run's marker"))
    except (OSError, ValueError, RecursionError):
        return None
    return marker if isinstance(marker, dict) and marker.get("tfllm") == "run" else None


def write_marker(directory: str, kind: str) -> dict:
    """Writes `directory`/.tfllm-run (whole or not at all): the directory is a tfllm run.

    Args:
      directory: the workdir (created if missing).
      kind: "train" or "import": what wrote it.

    Returns:
      The marker.
    """
    marker = {"tfllm": "run", "kind": kind, "run_id": uuid.uuid4().hex,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
              "pid": os.getpid()}
    write_json_atomic(directory, Workdir(directory).marker_file, marker)
    return marker


# ---- checking a workdir before a run -------------------------------------------------------
def check_workdir(workdir: str, settings: dict) -> WorkdirState:
    """What `workdir` holds, or `WorkdirError` when this run may not start there.

    Reads only; every client may call it. Refused: a file; a workdir whose checkpoint
    holds a different run (its own saved config is compared, not only config.yaml); a
    workdir without a checkpoint that holds anything but a dead tfllm run.

    Args:
      workdir: the run directory.
      settings: this run's validated config as the nested dict a checkpoint saves
        (`tfllm.config.loader.to_dict(config)`): its run-defining settings
        (`RUN_DEFINING`) are compared with those saved with the run in the workdir.
    """
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"--workdir {workdir} is a file, not a directory; choose another "
                           "path.")
    state = WorkdirState(workdir)
    state.checkpoint, state.metadata = state.workdir.newest_metadata()
    if state.has_checkpoint:
        # The newest committed checkpoint only: an import under a corrupt later one is
        # not a fresh start (restoring reports the corruption, or falls back).
        state.imported = (state.checkpoint == state.workdir.latest_checkpoint()
                          and _is_import(state.metadata))
        _check_same_run(state, settings)
        return state
    state.dead_run = _check_reusable(workdir)
    return state


def _is_import(meta: dict) -> bool:
    return meta.get("step") == 0 and "imported" in meta


def _check_same_run(state: WorkdirState, settings: dict) -> None:
    workdir, meta = state.path, state.metadata
    yaml_path = state.workdir.config_file
    meta_path = os.path.join(state.checkpoint, "metadata.json")
    saved, source = meta.get("config"), meta_path
    if not isinstance(saved, dict):  # a checkpoint of no tfllm run, or unreadable
        if not meta:
            return  # corrupt: the restore names it (or falls back)
        if not os.path.exists(yaml_path):
            raise WorkdirError(f"{meta_path} holds no config, so the run cannot be checked; "
                               "it is not a tfllm run's checkpoint: use a new --workdir.")
        saved, source = _read_yaml(yaml_path), yaml_path
    diffs = _differences(saved, settings,
                         (("model", None),) if state.imported else RUN_DEFINING)
    if diffs:
        reads = yaml_path if os.path.exists(yaml_path) else (
            f"the config of {meta_path}, {yaml_path} being missing")
        raise WorkdirError(
            f"{workdir} holds a different run ({'; '.join(diffs[:4])}"
            f"{'; ...' if len(diffs) > 4 else ''}; the run's settings are those saved in "
            f"{source}). Use a new --workdir, or resume that run with its own settings: "
            f"tfllm train --workdir {workdir} (without --config it reads {reads}).")


def _read_yaml(path: str) -> dict:
    try:  # bounded: a regular file, no aliases, no deep nesting (the loader's rules)
        saved = read_config_file(path)
    except (OSError, ConfigError) as e:
        raise WorkdirError(f"{path} cannot be read ({' '.join(str(e).split())}); restore it "
                           "or use a new --workdir.") from None
    if not isinstance(saved, dict):
        raise WorkdirError(f"{path} is not a tfllm config; restore it or use a new --workdir.")
    return saved


def _differences(saved: dict, current: dict, defining=RUN_DEFINING) -> list:
    diffs = []
    for section, key in defining:
        there = saved.get(section)
        there = there if isinstance(there, dict) else {}
        keys = [key] if key else sorted(set(there) | set(current[section]))
        for k in keys:
            a, b = there.get(k), current[section].get(k)
            if a != b:
                diffs.append(f"{section}.{k}: {a!r} there, {b!r} now")
    return diffs


def _is_leftover(name: str) -> bool:
    """A temporary file of one of tfllm's atomic writes of a top-level output."""
    return any(name == out + suffix for out in RUN_OUTPUTS for suffix in _LEFTOVER_SUFFIXES)


def _kind_of(workdir: str, name: str) -> str:
    """'shared', 'kept', 'output' (tfllm's, cleared with a dead run), 'marker' or
    'foreign' (not written by tfllm: never deleted)."""
    path = RunPaths(workdir).entry(name)
    if name in SHARED_DIRS + KEPT_DIRS:
        # Never deleted, so a link (a cache or checkpoints on another disk) is fine.
        return ("shared" if name in SHARED_DIRS else "kept") if os.path.isdir(path) \
            else "foreign"
    if os.path.islink(path):  # tfllm writes no links: clearing one is not ours to do
        return "foreign"
    if name in (MARKER, MARKER + ".part"):  # .part: another client's write, under way
        return "marker" if os.path.isfile(path) else "foreign"
    if name in RUN_OUTPUTS or _is_leftover(name):
        return "output"
    return "foreign"


def _names(workdir: str, names: list, limit: int = 6) -> str:
    shown = [n + ("/" if os.path.isdir(RunPaths(workdir).entry(n)) else "")
             for n in names[:limit]]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(shown) + more


def _check_reusable(workdir: str) -> bool:
    """For a workdir without a checkpoint: True when it holds a dead tfllm run (cleared
    when the run starts), False when empty (or only shared folders); else refuses."""
    if not os.path.isdir(workdir):
        return False
    names = sorted(os.listdir(workdir))
    kinds = {name: _kind_of(workdir, name) for name in names}
    foreign = [n for n in names if kinds[n] == "foreign"]
    never = "tfllm never deletes files it did not write"
    if foreign:
        raise WorkdirError(
            f"--workdir {workdir} has no checkpoint to resume and holds "
            f"{_names(workdir, foreign)}, which tfllm did not write; {never}: choose a new "
            "or empty --workdir, or move them out.")
    ours = [n for n in names if kinds[n] in ("output", "kept")]
    if ours and read_marker(workdir) is None:
        raise WorkdirError(
            f"--workdir {workdir} has no checkpoint to resume and holds "
            f"{_names(workdir, ours)} without the {MARKER} marker of a tfllm run, so they "
            f"may not be tfllm's; {never}: choose a new or empty --workdir, or delete them "
            "yourself.")
    return bool(ours) or MARKER in names


# ---- starting a run ------------------------------------------------------------------------
def start_run(state: WorkdirState, data) -> None:
    """Client 0, once the run's input is checked and before it writes anything there:
    clears a dead run's outputs (only the names tfllm writes) and writes the marker, the
    workdir's first file (a resumed run's workdir gets one too when it has none).

    Args:
      state: `check_workdir`'s result.
      data: this run's `DataConfig` (a tokenizer file it names inside the workdir is
        kept).
    """
    workdir = state.path
    if state.dead_run:
        keep = _configured_inside(data, workdir)
        for name in sorted(os.listdir(workdir)):
            if _kind_of(workdir, name) != "output" or name in keep:
                continue
            path = RunPaths(workdir).entry(name)  # only tfllm's names (tfllm.files)
            if os.path.isdir(path):
                files.remove_tree(workdir, path)
            else:
                files.remove(workdir, path)
    if not state.has_checkpoint or read_marker(workdir) is None:
        write_marker(workdir, "train")


def _configured_inside(data, workdir: str) -> set:
    """Top-level names of the workdir that the data settings use as input (a tokenizer
    file)."""
    if data.tokenizer != "file" or not data.tokenizer_path:
        return set()
    root = os.path.realpath(workdir)
    path = os.path.realpath(os.path.expanduser(data.tokenizer_path))
    if os.path.commonpath([root, path]) != root or path == root:
        return set()
    return {os.path.relpath(path, root).split(os.sep)[0]}


# ---- the tokenizer a run trains with -------------------------------------------------------
def check_tokenizer(state: WorkdirState, tokenizer) -> None:
    """Raises `WorkdirError` when the run in the workdir was trained with another tokenizer
    (the fingerprint saved in its checkpoint differs from `tokenizer`'s).

    Args:
      state: `check_workdir`'s result.
      tokenizer: this run's `tfllm.data.tokenizer.Tokenizer`, or None (synthetic data).
    """
    meta = state.metadata or {}
    if not state.has_checkpoint or state.imported or "tokenizer" not in meta:
        return  # a new run, or a checkpoint older than fingerprints: nothing to compare
    saved = meta["tokenizer"]
    now = tokenizer_fingerprint(tokenizer)
    if saved != now:
        where = getattr(tokenizer, "name", None) or "none (data.source=synthetic)"
        raise WorkdirError(
            f"{state.path}: the tokenizer differs from the one the run was trained with "
            f"(fingerprint {_short(saved)} in {state.checkpoint}, {_short(now)} now, from "
            f"{where}); put the run's own tokenizer back, or start a new --workdir.")


def tokenizer_fingerprint(tokenizer) -> Optional[str]:
    """What a checkpoint saves of the run's tokenizer: its kind and the sha256 of what
    defines it (`Tokenizer.fingerprint()`), or None without one (synthetic data)."""
    return None if tokenizer is None else tokenizer.fingerprint()


def _short(fingerprint) -> str:
    return "none" if fingerprint is None else str(fingerprint)[:28]
