"""Experiment trackers (tracking.loggers): a real MLflow store read back through MLflow's
client, and W&B's offline run folder read back record by record. No network: W&B runs
offline, MLflow into a store under tmp_path (a refused server is a closed port on
localhost), and neither tracker's telemetry is on.

One tiny run (module-scoped) trains 2 steps, then resumes to 4 with both trackers on, so
the resume into the same tracker run is tested on the same folders.
"""

import dataclasses
import glob
import json
import os
import signal
import socket
import struct
import sys

import pytest

from tests.harness import (TF_HANG_S, finish, kill_group, metrics_records, signal_at_step,
                           start_process, tfllm_command, tfllm_env, tiny_config,
                           tiny_overrides)
from tfllm.config import ConfigError, load_config
from tfllm.train.loop import train
from tfllm.train.trackers import TrackerError, Trackers, absolute_uri, start_trackers

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")


def _quiet_offline(mp, root):
    """Environment of a tracked test: W&B offline with its folders under `root`, MLflow's
    file store allowed (MLflow 3 refuses it by default), no telemetry, no login."""
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY",
                 "WANDB_BASE_URL", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        mp.delenv(name, raising=False)
    mp.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        mp.setenv(name, str(root / name.lower()))
    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    mp.setenv("DO_NOT_TRACK", "true")


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A run of 2 steps resumed to 4, logging to an MLflow file store and W&B offline."""
    tmp = tmp_path_factory.mktemp("tracked")
    uri = (tmp / "mlruns").as_uri()
    settings = {"train.log_every": 1, "train.eval_every": 0, "train.eval_steps": 1,
                "train.sample_tokens": 0, "tracking.loggers": "mlflow,wandb",
                "tracking.mlflow_uri": uri, "tracking.run_name": "tiny"}
    with pytest.MonkeyPatch.context() as mp:
        _quiet_offline(mp, tmp)
        workdir = tmp / "run"
        train(tiny_config(**settings, **{"train.steps": 2}), str(workdir))
        ids_first = json.loads((workdir / "trackers.json").read_text())
        train(tiny_config(**settings, **{"train.steps": 4}), str(workdir))
    return workdir, uri, ids_first


def _pairs(records, key):
    """(step, value) of every metrics.jsonl record holding `key`, in order."""
    return [(r["step"], r[key]) for r in records if key in r]


@pytest.mark.slow
def test_mlflow_holds_one_run_with_the_metrics_params_and_artefacts(tracked, tmp_path,
                                                                    monkeypatch):
    workdir, uri, ids_first = tracked
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    ids = json.loads((workdir / "trackers.json").read_text())
    assert ids["mlflow"] == ids_first["mlflow"]  # the resume continued the same run
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("tfllm")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    records = metrics_records(workdir)
    for key in ("loss", "grad_norm", "learning_rate", "tokens_per_s", "eval_loss"):
        history = sorted(client.get_metric_history(run.info.run_id, key),
                         key=lambda m: (m.step, m.timestamp))
        # the same float64 values metrics.jsonl holds, at the same steps
        assert [(m.step, m.value) for m in history] == _pairs(records, key), key
    assert [s for s, _ in _pairs(records, "loss")] == [1, 2, 3, 4]
    params = run.data.params
    assert params["model.hidden_dim"] == "64"
    assert params["train.steps"] == "2"  # MLflow keeps a parameter's first value
    assert params["tracking.loggers"] == '["mlflow", "wandb"]'
    assert run.data.tags["tfllm.workdir"] == str(workdir)
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert names == {"config.yaml", "costs.json", "loss.png"}
    for name in names:  # the files as the run left them (the resume uploaded them again)
        got = client.download_artifacts(run.info.run_id, name, str(tmp_path))
        assert open(got, "rb").read() == (workdir / name).read_bytes(), name


def _wandb_records(path):
    """The records of a W&B run file (run-ID.wandb): a LevelDB-style log of 32 KiB blocks
    after a 7-byte header, each record a protobuf `Record` in one or more chunks."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, out, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL chunk, or the LAST of several
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@pytest.mark.slow
def test_wandb_offline_folders_hold_one_run_with_the_metrics_config_and_files(tracked):
    workdir, _, ids_first = tracked
    run_id = json.loads((workdir / "trackers.json").read_text())["wandb"]["id"]
    assert run_id == ids_first["wandb"]["id"]  # the resume continued the same run
    folders = sorted(glob.glob(str(workdir / "wandb" / f"offline-run-*-{run_id}")))
    assert len(folders) == 2  # one per start, of one W&B run
    history, config, exits = [], {}, []
    for folder in folders:
        for record in _wandb_records(os.path.join(folder, f"run-{run_id}.wandb")):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append({i.key or ".".join(i.nested_key): json.loads(i.value_json)
                                for i in record.history.item})
            elif kind == "config":
                config.update({i.key or ".".join(i.nested_key): json.loads(i.value_json)
                               for i in record.config.update})
            elif kind == "exit":
                exits.append(record.exit.exit_code)
    records = metrics_records(workdir)
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        assert [(h["step"], h[key]) for h in history if key in h] == _pairs(records, key)
    assert config["model"]["hidden_dim"] == 64 and config["train"]["steps"] == 4
    assert exits == [0, 0]
    for name in ("config.yaml", "costs.json", "loss.png"):
        copy = os.path.join(folders[-1], "files", name)
        assert open(copy, "rb").read() == (workdir / name).read_bytes(), name


def _tracked_env(root):
    """`_quiet_offline`'s environment for a tfllm process."""
    with pytest.MonkeyPatch.context() as mp:
        _quiet_offline(mp, root)
        return tfllm_env(PYTHONUNBUFFERED="1")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_preempted_run_resumes_into_the_same_tracker_runs(tmp_path, monkeypatch):
    """SIGTERM: the run saves, exits 75 and its tracker runs end killed; the same command
    resumes them, and they end finished holding exactly the records of metrics.jsonl."""
    workdir, uri = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    settings = tiny_overrides(**{"train.steps": 30, "train.log_every": 1,
                                 "train.eval_every": 0, "train.eval_steps": 1,
                                 "train.sample_tokens": 0, "checkpoint.every": 100,
                                 "tracking.loggers": "mlflow,wandb",
                                 "tracking.mlflow_uri": uri})
    env = _tracked_env(tmp_path)
    proc = start_process(tfllm_command("train", "--workdir", str(workdir),
                                       *[a for s in settings for a in ("--set", s)]),
                         env, merge_stderr=True)
    watcher = signal_at_step(workdir / "metrics.jsonl", 3, signal.SIGTERM, proc.pid)
    try:
        rc, out, _ = finish(proc, TF_HANG_S)
    finally:
        kill_group(watcher)
    assert rc == 75, out[-3000:]
    ids = json.loads((workdir / "trackers.json").read_text())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store
    client = mlflow.MlflowClient(uri)
    assert client.get_run(ids["mlflow"]["run_id"]).info.status == "KILLED"
    rc, out, _ = finish(start_process(tfllm_command("train", "--workdir", str(workdir)), env,
                                      merge_stderr=True), TF_HANG_S)
    assert rc == 0, out[-3000:]
    assert json.loads((workdir / "trackers.json").read_text()) == ids
    run = client.get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == _pairs(metrics_records(workdir), "loss")
    folders = sorted(glob.glob(str(workdir / "wandb" / f"offline-run-*-{ids['wandb']['id']}")))
    exits = [r.exit.exit_code for f in folders
             for r in _wandb_records(os.path.join(f, f"run-{ids['wandb']['id']}.wandb"))
             if r.WhichOneof("record_type") == "exit"]
    assert exits == [75, 0]


# ---- starting: one line, or nothing logged at all ------------------------------------------
def _tracking(**values):
    overrides = [f"tracking.{k}={v}" for k, v in values.items()]
    return load_config(None, overrides)


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("uri", ["nosuchscheme://x", "http://127.0.0.1:{port}"])
def test_a_tracker_that_cannot_start_is_one_line_naming_the_setting(tmp_path, monkeypatch,
                                                                   uri):
    _quiet_offline(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused: at once
    uri = uri.format(port=_closed_port())
    config = _tracking(loggers="mlflow", mlflow_uri=uri)
    with pytest.raises(TrackerError) as e:
        start_trackers(config.tracking, {}, str(tmp_path), resumed=False, say=print)
    message = str(e.value)
    assert "\n" not in message and "tracking.mlflow_uri" in message and uri in message
    assert "remove mlflow from tracking.loggers" in message
    assert not (tmp_path / "trackers.json").exists()  # no run to resume into


def test_tfllm_train_with_a_tracker_that_cannot_start_exits_2_before_step_1(
        tmp_path, monkeypatch, capsys):
    """The command the docs show (tfllm train --workdir runs/x --set
    tracking.loggers=mlflow,wandb), with a tiny model and a store that cannot be opened."""
    from tfllm.cli.main import main
    _quiet_offline(monkeypatch, tmp_path)
    settings = [a for s in tiny_overrides(**{"train.sample_tokens": 0}) for a in ("--set", s)]
    code = main(["train", "--workdir", str(tmp_path / "run"), *settings,
                 "--set", "tracking.loggers=mlflow,wandb",
                 "--set", "tracking.mlflow_uri=nosuchscheme://x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("tfllm train: error: tracking.mlflow_uri: MLflow cannot start")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""  # no step ran
    assert not (tmp_path / "run" / "trackers.json").exists()


def test_a_dead_run_s_tracker_record_is_cleared_and_w_and_b_s_folder_kept(tmp_path):
    """A run that died before its first checkpoint starts again with new tracker runs;
    W&B's folder (offline runs not yet synced) is never deleted."""
    from tfllm.checkpoint.workdir import check_workdir, start_run, write_marker
    write_marker(str(tmp_path), "train")
    (tmp_path / "trackers.json").write_text('{"wandb": {"id": "x"}}')
    (tmp_path / "wandb" / "offline-run-1-x").mkdir(parents=True)
    config = load_config(None, [])
    state = check_workdir(str(tmp_path), dataclasses.asdict(config))
    start_run(state, config.data)
    assert sorted(os.listdir(tmp_path)) == [".tfllm-run", "wandb"]
    assert os.listdir(tmp_path / "wandb") == ["offline-run-1-x"]


def test_a_tracker_not_installed_is_one_line_with_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    config = _tracking(loggers="wandb")
    with pytest.raises(TrackerError, match=r"pip install 'tfllm\[trackers\]'"):
        start_trackers(config.tracking, {}, str(tmp_path), resumed=False)


def test_only_client_0_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("DTENSOR_CLIENT_ID", "1")
    config = _tracking(loggers="mlflow,wandb", mlflow_uri="nosuchscheme://x")
    trackers = start_trackers(config.tracking, {}, str(tmp_path), resumed=False)
    assert trackers.backends == [] and os.listdir(tmp_path) == []
    trackers.log({"step": 1, "loss": 1.0})  # nothing, and no error


def test_a_tracker_failing_mid_run_is_one_warning_and_the_run_goes_on(tmp_path,
                                                                      monkeypatch):
    _quiet_offline(monkeypatch, tmp_path)
    lines = []
    store = tmp_path / "mlruns"
    config = _tracking(loggers="mlflow", mlflow_uri=store.as_uri())
    trackers = start_trackers(config.tracking, {"model": {"hidden_dim": 64}}, str(tmp_path),
                              resumed=False, say=lines.append)
    trackers.log({"step": 1, "loss": 2.0})
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"]
    for meta in glob.glob(str(store / "*" / run_id / "meta.yaml")):
        os.remove(meta)  # the run is gone from the store: every write fails from here on
    trackers.log({"step": 2, "loss": 1.5})
    trackers.log({"step": 3, "loss": 1.0})  # the tracker is dropped: no second warning
    trackers.end()
    warnings = [line for line in lines if "warning" in line]
    assert len(warnings) == 1 and "MLflow failed" in warnings[0]
    assert "the run goes on without MLflow" in warnings[0]


def test_wandb_auto_without_a_login_logs_offline_with_a_note(tmp_path, monkeypatch):
    _quiet_offline(monkeypatch, tmp_path)
    monkeypatch.delenv("WANDB_MODE")  # auto decides
    wandb.teardown()  # W&B's settings of this process, read from the environment again
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    lines = []
    config = _tracking(loggers="wandb")
    with start_trackers(config.tracking, {}, str(tmp_path), resumed=False,
                        say=lines.append) as trackers:
        trackers.log({"step": 1, "loss": 2.0})
    assert any("W&B is not logged in" in line and "offline" in line for line in lines)
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*"))


def test_a_resumed_run_with_an_unreadable_record_is_one_line(tmp_path):
    (tmp_path / "trackers.json").write_text("[1")
    config = _tracking(loggers="mlflow")
    with pytest.raises(TrackerError, match="trackers.json cannot be read.*delete it"):
        start_trackers(config.tracking, {}, str(tmp_path), resumed=True)


def test_trackers_end_as_the_run_did():
    class Recorder:
        title = "recorder"

        def __init__(self):
            self.ended = []

        def end(self, status):
            self.ended.append(status)

    from tfllm.train.preemption import Preempted
    for error, status in ((None, "finished"), (Preempted(3, "SIGTERM"), "killed"),
                          (ValueError("x"), "failed")):
        backend = Recorder()
        Trackers([backend]).end(error)
        assert backend.ended == [status]


def test_local_stores_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_uri("./mlruns") == (tmp_path / "mlruns").as_uri()
    assert absolute_uri("file:mlruns") == (tmp_path / "mlruns").as_uri()
    assert absolute_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path}/mlflow.db"
    for kept in ("sqlite:////abs/mlflow.db", "http://host:5000", "databricks",
                 "file:///abs/mlruns"):
        assert absolute_uri(kept) == kept


def test_tracking_loggers_are_checked_by_the_config():
    with pytest.raises(ConfigError, match="tracking.loggers: 'tensorboard' is not one of"):
        _tracking(loggers="mlflow,tensorboard")
