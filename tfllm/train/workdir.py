"""The run directory: what a run writes there, and when it may start in one.

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
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
import uuid
from typing import Optional

import yaml

from tfllm.checkpoint import CheckpointError, Reader, committed, latest
from tfllm.checkpoint.storage import write_json_atomic
from tfllm.config.loader import ConfigError, to_dict

#: (section, key or None for the whole section) that define a run and must not change.
RUN_DEFINING = (("model", None), ("data", None), ("optimizer", None),
                ("precision", None), ("train", "global_batch_size"),
                ("train", "grad_accum_steps"), ("train", "seed"))

#: the marker a run (or an import) writes first: the workdir is tfllm's
MARKER = ".tfllm-run"

#: the cost report of the step (`tfllm.train.costs.CostReport.as_dict()`), after step one
COSTS_FILE = "costs.json"

#: files and folders a run writes; cleared when a dead run without checkpoints is reused
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "loss.png", "config.yaml", COSTS_FILE,
               "tokenizer", "pretrained.json")

#: tfllm's folders that are kept: checkpoints (the checkpointer removes interrupted saves
#: itself), and those written before a run starts (`tfllm launch`'s logs, heartbeats and
#: client logs; the XLA cache of `train.xla_cache=auto`), which may exist without a marker
KEPT_DIRS = ("checkpoints",)
SHARED_DIRS = ("logs", "xla_cache")

#: suffixes of tfllm's atomic writes (a temporary name, then a rename): config.yaml.tmp,
#: metrics.jsonl.tmp, costs.json.part, loss.png.tmp.png
_LEFTOVER_SUFFIXES = (".tmp", ".part", ".tmp.png")


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


# ---- the marker ----------------------------------------------------------------------------
def read_marker(directory: str) -> Optional[dict]:
    """The marker of a tfllm run (or import) in `directory`, or None when there is none (an
    unreadable or foreign file counts as none)."""
    path = os.path.join(directory, MARKER)
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
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
    os.makedirs(directory, exist_ok=True)
    marker = {"tfllm": "run", "kind": kind, "run_id": uuid.uuid4().hex,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
              "pid": os.getpid()}
    write_json_atomic(os.path.join(directory, MARKER), marker)
    return marker


# ---- checking a workdir before a run -------------------------------------------------------
def check_workdir(workdir: str, config) -> WorkdirState:
    """What `workdir` holds, or `WorkdirError` when this run may not start there.

    Reads only; every client may call it. Refused: a file; a workdir whose checkpoint
    holds a different run (its own saved config is compared, not only config.yaml); a
    workdir without a checkpoint that holds anything but a dead tfllm run.

    Args:
      workdir: the run directory.
      config: this run's validated config.
    """
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"--workdir {workdir} is a file, not a directory; choose another "
                           "path.")
    state = WorkdirState(workdir)
    checkpoints = os.path.join(workdir, "checkpoints")
    state.checkpoint, state.metadata = newest_metadata(checkpoints)
    if state.has_checkpoint:
        # The newest committed checkpoint only: an import under a corrupt later one is
        # not a fresh start (restoring reports the corruption, or falls back).
        state.imported = (state.checkpoint == latest(checkpoints)
                          and _is_import(state.metadata))
        _check_same_run(state, config)
        return state
    state.dead_run = _check_reusable(workdir)
    return state


def newest_metadata(checkpoint_dir: str):
    """(path, metadata) of the newest committed checkpoint whose metadata can be read
    (corrupt ones are passed over: restoring decides what to do with them, per
    checkpoint.on_corruption), or (None, None) when there is none."""
    steps = committed(checkpoint_dir)
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


def saved_run_config(workdir: str) -> Optional[dict]:
    """The config (a nested dict) saved in the workdir's newest readable committed
    checkpoint, or None: what a resume without --config may use when config.yaml is
    gone (`tfllm.config.loader.config_from_dict`)."""
    _, meta = newest_metadata(os.path.join(workdir, "checkpoints"))
    config = (meta or {}).get("config")
    return config if isinstance(config, dict) else None


def _is_import(meta: dict) -> bool:
    return meta.get("step") == 0 and "imported" in meta


def _check_same_run(state: WorkdirState, config) -> None:
    workdir, meta = state.path, state.metadata
    yaml_path = os.path.join(workdir, "config.yaml")
    meta_path = os.path.join(state.checkpoint, "metadata.json")
    saved, source = meta.get("config"), meta_path
    if not isinstance(saved, dict):  # a checkpoint of no tfllm run, or unreadable
        if not meta:
            return  # corrupt: the restore names it (or falls back)
        if not os.path.exists(yaml_path):
            raise WorkdirError(f"{meta_path} holds no config, so the run cannot be checked; "
                               "it is not a tfllm run's checkpoint: use a new --workdir.")
        saved, source = _read_yaml(yaml_path), yaml_path
    diffs = _differences(saved, to_dict(config),
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
    try:
        with open(path, encoding="utf-8") as f:
            saved = yaml.safe_load(f) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:
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
    path = os.path.join(workdir, name)
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
    shown = [n + ("/" if os.path.isdir(os.path.join(workdir, n)) else "")
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
def start_run(state: WorkdirState, config) -> None:
    """Client 0, once the run's input is checked and before it writes anything there:
    clears a dead run's outputs (only the names tfllm writes) and writes the marker, the
    workdir's first file (a resumed run's workdir gets one too when it has none).

    Args:
      state: `check_workdir`'s result.
      config: this run's config (a tokenizer it names inside the workdir is kept).
    """
    workdir = state.path
    if state.dead_run:
        keep = _configured_inside(config, workdir)
        for name in sorted(os.listdir(workdir)):
            if _kind_of(workdir, name) != "output" or name in keep:
                continue
            path = os.path.join(workdir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    if not state.has_checkpoint or read_marker(workdir) is None:
        write_marker(workdir, "train")


def _configured_inside(config, workdir: str) -> set:
    """Top-level names of the workdir that the config uses as input (a tokenizer file)."""
    if config.data.tokenizer != "file" or not config.data.tokenizer_path:
        return set()
    root = os.path.realpath(workdir)
    path = os.path.realpath(os.path.expanduser(config.data.tokenizer_path))
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


# ---- outputs -------------------------------------------------------------------------------
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
    path = os.path.join(workdir, COSTS_FILE)
    write_json_atomic(path, costs)
    return path
