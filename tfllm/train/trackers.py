"""Experiment trackers: MLflow and Weights & Biases beside metrics.jsonl and TensorBoard.

`tracking.loggers` names the trackers a run also logs to. Client 0 alone starts them
(`start_trackers`), once the run holds its workdir and has saved its config, before step 1.
A new tfllm run starts a new tracker run and keeps its id in WORKDIR/trackers.json; a
resumed run reads that file and continues the same tracker run (MLflow's run id in the
same store, W&B's run id with resume="allow"). Each tracker gets every record metrics.jsonl
gets, by step and under the same names; the resolved config as parameters; config.yaml,
costs.json and loss.png as artefacts. Its run ends with the tfllm run: finished, killed (a
signal: the run saved and exits 75) or failed.

Failures. A tracker that cannot start (its package missing, a bad URI, an unreachable
server, W&B online without a login) is `TrackerError`: one line naming the setting and its
fix, exit 2, before the first step. That is what users of Hugging Face's Trainer (and so
TRL) know: its MLflow and W&B callbacks raise from `on_train_begin`, so a run asked to be
tracked never trains for days untracked. A tracker that fails later (a server gone
mid-run) costs one warning line and that tracker; the run goes on (metrics.jsonl and
TensorBoard keep every record).

mlflow (~2 s) and wandb are imported here, inside the functions, only when a run names
them: `import tfllm` and runs without trackers do not pay for them, and neither package is
needed unless named (pip install 'tfllm[trackers]').
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import time
from typing import Callable, Optional
from urllib.parse import urlparse

from tfllm import files
from tfllm.checkpoint.storage import write_json_atomic
from tfllm.checkpoint.workdir import Workdir
from tfllm.config.loader import ConfigError
from tfllm.confined import read_regular
from tfllm.contracts import PREEMPTED_EXIT_CODE, client_id
from tfllm.train.preemption import Preempted

__all__ = ["TrackerError", "Trackers", "check_installed", "start_trackers"]

_INSTALL = "pip install 'tfllm[trackers]'"
#: MLflow's limits (mlflow.utils.validation): a parameter's value, parameters per batch
_PARAM_CHARS, _PARAMS_PER_BATCH = 6000, 100


class TrackerError(ConfigError):
    """A tracker that cannot start: one line naming the setting and the fix (exit 2)."""


def check_installed(tracking) -> None:
    """Raises `TrackerError` when a tracker named in `tracking.loggers` is not installed
    (client 0 only: the others log nothing). Imports nothing.

    Args:
      tracking: the run's `TrackingConfig`.
    """
    if client_id() != 0:
        return
    for name in dict.fromkeys(tracking.loggers):
        if importlib.util.find_spec(name) is None:
            raise TrackerError(f"tracking.loggers names {name}, which is not installed: "
                               f"{_INSTALL} (or pip install {name}), or remove {name} from "
                               "tracking.loggers.")


def _line(error: BaseException) -> str:
    """An error as one short line: its type and its message's first line."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Trackers:
    """The run's started trackers (none on clients other than 0, nor without
    `tracking.loggers`). Used as a context manager, it ends their runs on leaving: finished,
    killed (`Preempted`, KeyboardInterrupt) or failed (any other error).

    Args:
      backends: the started trackers.
      say: prints one line (the progress display's `message`).
    """

    def __init__(self, backends=(), say: Callable[[str], None] = print):
        self.backends, self.say = list(backends), say

    def log(self, record: dict) -> None:
        """One record of metrics.jsonl ({"step": N, name: value, ...}), at its step."""
        values = {k: float(v) for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if values:
            self._each("log", int(record["step"]), values)

    def artifact(self, path: str) -> None:
        """Uploads a file of the run (config.yaml, costs.json, loss.png) as it is now."""
        if os.path.isfile(path):
            self._each("artifact", path)

    def end(self, error: Optional[BaseException] = None) -> None:
        """Ends every tracker's run, as `error` says (None: finished)."""
        status = ("finished" if error is None else
                  "killed" if isinstance(error, (Preempted, KeyboardInterrupt)) else "failed")
        self._each("end", status)
        self.backends = []

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, kind, error, tb) -> bool:
        self.end(error)
        return False

    def _each(self, method: str, *args) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, method)(*args)
            except Exception as e:  # noqa: BLE001  (a server gone mid-run fails in many ways)
                self.backends.remove(backend)
                self.say(f"tfllm: warning: {backend.title} failed ({_line(e)}); the run goes "
                         f"on without {backend.title} (metrics.jsonl and TensorBoard keep "
                         "every record)")


def start_trackers(tracking, settings: dict, workdir: str, resumed: bool,
                   say: Callable[[str], None] = print) -> Trackers:
    """Starts (or, for a resumed run, continues) the run of each tracker of
    `tracking.loggers`, on client 0; says one line for each; uploads config.yaml.

    Args:
      tracking: the run's `TrackingConfig`.
      settings: the resolved config as a nested dict (`to_dict(config)`): the parameters.
      workdir: the run directory (its config.yaml saved; the run's lock held).
      resumed: the run resumed from its checkpoint: continue the tracker runs that
        WORKDIR/trackers.json names.
      say: prints one line.

    Raises:
      TrackerError: a tracker cannot start (the trackers started before it are ended).
    """
    if client_id() != 0 or not tracking.loggers:
        return Trackers(say=say)
    check_installed(tracking)
    paths = Workdir(workdir)
    ids = read_ids(paths) if resumed else {}
    name = tracking.run_name or os.path.basename(os.path.abspath(workdir))
    trackers = Trackers(say=say)
    try:
        for logger in dict.fromkeys(tracking.loggers):
            backend = _BACKENDS[logger].start(tracking, paths, name, ids.get(logger),
                                              settings, say)
            trackers.backends.append(backend)
            ids[logger] = backend.ids
            # at once: a run that dies from here on resumes into this tracker run
            write_json_atomic(paths.path, paths.trackers_file, ids)
            say(backend.line)
    except BaseException as e:
        trackers.end(e)
        raise
    trackers.artifact(paths.config_file)
    return trackers


def read_ids(paths: Workdir) -> dict:
    """The tracker runs of a run (WORKDIR/trackers.json), or {} when it has none."""
    path = paths.trackers_file
    if not os.path.lexists(path):
        return {}
    fix = "delete it to start new tracker runs"
    try:  # a small regular file, as tfllm wrote it
        ids = json.loads(read_regular(path, 1 << 16, "a run's tracker ids", TrackerError, fix))
    except (OSError, ValueError, RecursionError) as e:
        if isinstance(e, TrackerError):
            raise
        raise TrackerError(f"{path} cannot be read ({_line(e)}); {fix}.") from None
    if not isinstance(ids, dict) or not all(isinstance(v, dict) for v in ids.values()):
        raise TrackerError(f"{path} is not tfllm's record of tracker runs; {fix}.")
    return ids


def absolute_uri(uri: str) -> str:
    """An MLflow tracking URI with a local path made absolute, so that a run resumed from
    another directory logs into the same store: ./mlruns and file:./mlruns become
    file:///.../mlruns, sqlite:///mlflow.db sqlite:////.../mlflow.db; others are kept."""
    parsed = urlparse(uri)
    if uri == "databricks":  # MLflow's name for a Databricks workspace, not a folder
        return uri
    if parsed.scheme in ("", "file") and not parsed.netloc:
        return pathlib.Path(os.path.abspath(os.path.expanduser(parsed.path))).as_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    return uri


def _params(settings: dict) -> dict:
    """The config as MLflow parameters: {"section.key": text} (lists and null as JSON)."""
    return {f"{section}.{key}": (value if isinstance(value, str)
                                 else json.dumps(value))[:_PARAM_CHARS]
            for section, values in settings.items() for key, value in values.items()}


class _MLflow:
    """An MLflow run, through `MlflowClient` (no global active run is set)."""

    title = "MLflow"
    _STATUS = {"finished": "FINISHED", "killed": "KILLED", "failed": "FAILED"}

    def __init__(self, client, run_id: str, uri: str, line: str):
        self.client, self.run_id, self.uri, self.line = client, run_id, uri, line
        self.ids = {"run_id": run_id, "tracking_uri": uri}

    @classmethod
    def start(cls, tracking, paths: Workdir, name: str, stored: Optional[dict],
              settings: dict, say) -> "_MLflow":
        import mlflow  # lazy: see the module's docstring
        from mlflow.entities import Param
        stored = stored or {}
        # where a resumed run started, unless tracking.mlflow_uri says otherwise; then
        # MLFLOW_TRACKING_URI, then MLflow's default store (a local file)
        uri = absolute_uri(tracking.mlflow_uri or stored.get("tracking_uri")
                           or mlflow.get_tracking_uri())
        try:
            client = mlflow.MlflowClient(tracking_uri=uri)
            run_id = cls._resumable(client, stored, uri, say)
            if run_id is not None:
                client.update_run(run_id, status="RUNNING")
                logged = client.get_run(run_id).data.params
            else:
                experiment = (tracking.mlflow_experiment
                              or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "tfllm")
                found = client.get_experiment_by_name(experiment)
                experiment_id = (found.experiment_id if found is not None
                                 else client.create_experiment(experiment))
                run_id = client.create_run(
                    experiment_id, run_name=name,
                    tags={"tfllm.workdir": os.path.abspath(paths.path)}).info.run_id
                logged = {}
            # MLflow keeps a parameter's first value: a resumed run adds only new keys
            # (its config.yaml artefact is the latest start's)
            params = [Param(k, v) for k, v in _params(settings).items() if k not in logged]
            for i in range(0, len(params), _PARAMS_PER_BATCH):
                client.log_batch(run_id, params=params[i:i + _PARAMS_PER_BATCH])
        except Exception as e:  # noqa: BLE001  (a bad URI, a refused or missing server)
            folder = (" (MLflow 3 opens a file: store only with MLFLOW_ALLOW_FILE_STORE=true)"
                      if uri.startswith("file:") else "")
            raise TrackerError(
                f"tracking.mlflow_uri: MLflow cannot start a run at {uri}{folder} "
                f"({_line(e)}); set "
                "tracking.mlflow_uri (or MLFLOW_TRACKING_URI) to a reachable tracking server "
                "or a local store such as sqlite:///mlflow.db, or remove mlflow from "
                "tracking.loggers.") from None
        verb = "continues" if stored.get("run_id") == run_id else "logs to"
        return cls(client, run_id, uri, f"tfllm: {verb} MLflow run {run_id} ({name}) at "
                                        f"{uri} (mlflow ui --backend-store-uri {uri})")

    @staticmethod
    def _resumable(client, stored: dict, uri: str, say) -> Optional[str]:
        """The stored run's id when it is in this store, else None (a new run)."""
        from mlflow.exceptions import MlflowException
        run_id = stored.get("run_id")
        if not isinstance(run_id, str):
            return None
        if stored.get("tracking_uri") != uri:
            say(f"tfllm: note: the run's MLflow run {run_id} is at "
                f"{stored.get('tracking_uri')}, tracking.mlflow_uri says {uri}: a new MLflow "
                "run starts there")
            return None
        try:
            client.get_run(run_id)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            say(f"tfllm: note: MLflow run {run_id} is gone from {uri}: a new MLflow run "
                "starts")
            return None
        return run_id

    def log(self, step: int, values: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in values.items()])

    def artifact(self, path: str) -> None:
        self.client.log_artifact(self.run_id, path)

    def end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=self._STATUS[status])


class _WandB:
    """A Weights & Biases run: metrics against tfllm's step (its `step` metric)."""

    title = "W&B"

    def __init__(self, run, ids: dict, line: str):
        self.run, self.ids, self.line = run, ids, line

    @classmethod
    def start(cls, tracking, paths: Workdir, name: str, stored: Optional[dict],
              settings: dict, say) -> "_WandB":
        import wandb  # lazy: see the module's docstring
        stored = stored or {}
        project = (tracking.wandb_project or stored.get("project")
                   or os.environ.get("WANDB_PROJECT") or "tfllm")
        entity = (tracking.wandb_entity or stored.get("entity")
                  or os.environ.get("WANDB_ENTITY") or None)
        same = stored.get("project") == project and stored.get("entity") == entity
        run_id = stored.get("id") if same and isinstance(stored.get("id"), str) else None
        if stored.get("id") and run_id is None:
            say(f"tfllm: note: the run's W&B run {stored.get('id')} is in project "
                f"{stored.get('project')}, tracking says {project}: a new W&B run starts")
        # W&B's folder: WANDB_DIR when set, else WORKDIR/wandb (made here: no link)
        folder = None if os.environ.get("WANDB_DIR") else paths.path
        if folder is not None:
            files.make_dirs(paths.path, paths.wandb_dir)
        mode = None if tracking.wandb_mode == "auto" else tracking.wandb_mode

        def init(mode):
            return wandb.init(
                project=project, entity=entity, name=name, id=run_id, resume="allow",
                dir=folder, mode=mode,
                # no console capture (the progress bar is tfllm's), no lines of W&B's
                # own (the line below says where the run is), no other run ended
                settings=wandb.Settings(console="off", silent=True, reinit="create_new"))

        try:
            try:
                run = init(mode)
            except wandb.errors.UsageError as e:
                # auto, no WANDB_MODE, not logged in: W&B refuses before any network call
                if mode is not None or os.environ.get("WANDB_MODE"):
                    raise
                say(f"tfllm: note: W&B is not logged in ({_line(e)}): logging offline "
                    "(wandb login, then wandb sync, uploads it)")
                run = init("offline")
            run.config.update(settings, allow_val_change=True)
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
        except Exception as e:  # noqa: BLE001  (no login, no network, a bad project)
            raise TrackerError(
                f"tracking.loggers: W&B cannot start a run in project {project} "
                f"({_line(e)}); log in (wandb login), set tracking.wandb_mode=offline (or "
                "WANDB_MODE=offline), or remove wandb from tracking.loggers.") from None
        offline = run.settings.mode == "offline"
        run_folder = os.path.dirname(run.dir)  # run.dir is its files/ folder
        verb = "continues" if run_id is not None else "logs to"
        where = (f"offline in {run_folder} (wandb sync {run_folder} uploads it)" if offline
                 else run.url or "online")
        ids = {"id": run.id, "project": project, "entity": entity}
        return cls(run, ids, f"tfllm: {verb} W&B run {run.id} ({name}), {where}")

    def log(self, step: int, values: dict) -> None:
        self.run.log({"step": step, **values})

    def artifact(self, path: str) -> None:
        # a copy in the run's files/ folder (W&B would link to the workdir's file, which
        # tfllm rewrites), uploaded now when online, by wandb sync when offline
        name = os.path.basename(path)
        copy = files.copy_file(self.run.dir, path, name)
        self.run.save(copy, base_path=self.run.dir, policy="now")

    def end(self, status: str) -> None:
        self.run.finish(exit_code={"finished": 0, "killed": PREEMPTED_EXIT_CODE,
                                   "failed": 1}[status])


_BACKENDS = {"mlflow": _MLflow, "wandb": _WandB}
