"""The workdir: its paths, the weights it restores, and its rules (what a run may start
in, what it clears, and what a resume compares).

No training: checkpoints here hold one small variable and the metadata a run saves, or
the tiny run state of `source_run`.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.checkpoint.helpers import assert_same, gathered
from tests.harness import sections, snapshot_tree, tiny_config
from tfllm.checkpoint import Checkpointer, model_variables
from tfllm.config.loader import to_dict
from tfllm.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, train_sentencepiece
from tfllm.pretrained import import_preset
from tfllm.families import PretrainedError
from tfllm.config.loader import config_from_dict
from tfllm.checkpoint.workdir import (MARKER, RUN_OUTPUTS, Workdir, WorkdirError,
                                      check_tokenizer, check_workdir, read_marker,
                                      start_run, tokenizer_fingerprint)
from tfllm.models import build_model


def _config(**extra):
    return tiny_config("gpt", **extra)


def _settings(**extra):
    """The settings `check_workdir` compares: the tiny config as a checkpoint saves it."""
    return to_dict(_config(**extra))



def _dead_run(workdir, marker=True):
    """The outputs of a run that died before its first checkpoint."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "costs.json",
                 "config.yaml.tmp", "costs.json.part", "loss.png.tmp.png"):
        (workdir / name).write_text("x")
    (workdir / "tensorboard").mkdir()
    (workdir / "tensorboard" / "events.out.tfevents.1").write_text("x")
    (workdir / "tokenizer").mkdir()
    (workdir / "tokenizer" / "tokenizer.model").write_text("x")
    (workdir / "checkpoints" / "step_00000002.tmp-0badc0de").mkdir(parents=True)
    if marker:
        (workdir / MARKER).write_text(json.dumps({"tfllm": "run", "kind": "train"}))


# ---- a workdir without a checkpoint --------------------------------------------------------
def test_a_missing_or_empty_workdir_starts_and_gets_the_marker_first(tmp_path):
    for workdir in (tmp_path / "new", tmp_path / "empty"):
        if workdir.name == "empty":
            workdir.mkdir()
        state = check_workdir(str(workdir), _settings())
        assert not state.has_checkpoint and not state.dead_run
        start_run(state, _config().data)
        assert os.listdir(workdir) == [MARKER]
        assert read_marker(str(workdir))["kind"] == "train"


def test_a_marker_being_written_by_client_0_is_not_refused_by_the_others(tmp_path):
    # Every client checks the workdir; client 0 may be writing the marker (to .part, then
    # renamed) while another looks.
    (tmp_path / (MARKER + ".part")).write_text("{")
    assert not check_workdir(str(tmp_path), _settings()).dead_run


def test_logs_and_xla_cache_written_before_the_run_are_allowed(tmp_path):
    # `tfllm launch` writes WORKDIR/logs and train.xla_cache=auto WORKDIR/xla_cache
    # before the run checks its workdir: they are tfllm's, never cleared.
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank_0.log").write_text("started")
    (tmp_path / "xla_cache" / "client_0" / "autotune").mkdir(parents=True)
    state = check_workdir(str(tmp_path), _settings())
    start_run(state, _config().data)
    assert sorted(os.listdir(tmp_path)) == [MARKER, "logs", "xla_cache"]
    assert (tmp_path / "logs" / "rank_0.log").read_text() == "started"


@pytest.mark.parametrize("names", [["notes.txt"], ["data"], ["config.yaml", "notes.txt"]])
def test_files_tfllm_did_not_write_are_refused_and_kept(tmp_path, names):
    _dead_run(tmp_path)  # even beside a dead run's marker
    for name in names:
        if name == "data":
            (tmp_path / "data").mkdir()
            (tmp_path / "data" / "corpus.txt").write_text("mine")
        else:
            (tmp_path / name).write_text("mine")
    before = snapshot_tree(tmp_path)
    foreign = [n + "/" if n == "data" else n for n in names if n != "config.yaml"]
    with pytest.raises(WorkdirError) as e:
        check_workdir(str(tmp_path), _settings())
    message = str(e.value)
    assert "\n" not in message and "tfllm never deletes files it did not write" in message
    assert f"holds {', '.join(foreign)}, which tfllm did not write" in message
    assert snapshot_tree(tmp_path) == before


def test_tfllm_named_files_without_the_marker_are_refused_and_kept(tmp_path):
    # The case: a user's own config.yaml, metrics.jsonl and tensorboard/ were
    # removed by `tfllm train` in their folder.
    (tmp_path / "config.yaml").write_text("my: settings\n")
    (tmp_path / "metrics.jsonl").write_text('{"mine": 1}\n')
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events").write_text("mine")
    before = snapshot_tree(tmp_path)
    with pytest.raises(WorkdirError, match=r"holds config.yaml, metrics.jsonl, tensorboard/ "
                                           rf"without the {MARKER} marker of a tfllm run"):
        check_workdir(str(tmp_path), _settings())
    assert snapshot_tree(tmp_path) == before


def test_a_link_is_never_tfllms_to_clear(tmp_path):
    _dead_run(tmp_path / "run")
    (tmp_path / "mine").mkdir()
    os.rename(tmp_path / "run" / "tensorboard", tmp_path / "tb")
    os.symlink(tmp_path / "mine", tmp_path / "run" / "tensorboard")
    with pytest.raises(WorkdirError, match="tensorboard/, which tfllm did not write"):
        check_workdir(str(tmp_path / "run"), _settings())


def test_a_dead_run_with_its_marker_is_cleared_of_its_own_outputs_only(tmp_path):
    _dead_run(tmp_path)
    (tmp_path / "logs").mkdir()
    state = check_workdir(str(tmp_path), _settings())
    assert state.dead_run and not state.has_checkpoint
    old = read_marker(str(tmp_path))
    start_run(state, _config().data)
    # checkpoints/ stays: the checkpointer removes interrupted saves itself.
    assert sorted(os.listdir(tmp_path)) == [MARKER, "checkpoints", "logs"]
    assert read_marker(str(tmp_path))["run_id"] != old.get("run_id")


def test_a_tokenizer_the_config_names_inside_the_workdir_is_kept(tmp_path):
    _dead_run(tmp_path)
    cfg = _config(**{"data.source": "text", "data.paths": '["x.txt"]', "data.tokenizer": "file",
                     "data.tokenizer_path": str(tmp_path / "tokenizer" / "tokenizer.model")})
    start_run(check_workdir(str(tmp_path), to_dict(cfg)), cfg.data)
    assert (tmp_path / "tokenizer" / "tokenizer.model").exists()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_marker_that_is_not_a_file_is_not_tfllms(tmp_path):
    (tmp_path / MARKER).mkdir()
    with pytest.raises(WorkdirError, match=rf"holds {MARKER}/, which tfllm did not write"):
        check_workdir(str(tmp_path), _settings())


def test_a_file_is_not_a_workdir(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(WorkdirError, match="is a file, not a directory"):
        check_workdir(str(tmp_path / "f"), _settings())


# ---- a workdir with a checkpoint: the run's identity ----------------------------------------
def _checkpoint(workdir, config, step=2, tokenizer="byte", **extra):
    meta = {"step": step, "config": to_dict(config), "tokenizer": tokenizer, **extra}
    Checkpointer(str(workdir / "checkpoints")).save(
        step, {"w": tf.Variable(np.zeros((2, 3), np.float32))}, meta)


@pytest.mark.parametrize("override, key", [
    ("data.seed=7", "data.seed"), ("optimizer.learning_rate=0.5", "optimizer.learning_rate"),
    ("precision.policy=bfloat16", "precision.policy"), ("train.seed=3", "train.seed"),
    ("data.source=corpus", "data.source")])
def test_a_resume_is_compared_with_the_checkpoints_own_config(tmp_path, override, key):
    saved = _config()
    _checkpoint(tmp_path, saved)
    # No config.yaml (deleted): the checkpoint's metadata still holds the run's settings.
    check_workdir(str(tmp_path), to_dict(saved))  # the same settings resume
    check_workdir(str(tmp_path), _settings(**{"train.steps": 99, "mesh.axes": "data=2"}))
    with pytest.raises(WorkdirError) as e:
        check_workdir(str(tmp_path), _settings(**dict([override.split("=", 1)])))
    message = str(e.value)
    assert f"{tmp_path} holds a different run ({key}:" in message and "\n" not in message
    assert "step_00000002/metadata.json" in message and "config.yaml being missing" in message


def test_a_resumed_run_deletes_nothing_and_gets_a_marker_if_it_had_none(tmp_path):
    _checkpoint(tmp_path, _config())
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    state = check_workdir(str(tmp_path), _settings())
    start_run(state, _config().data)
    assert sorted(os.listdir(tmp_path)) == [MARKER, "checkpoints", "metrics.jsonl",
                                            "notes.txt"]
    marker = read_marker(str(tmp_path))
    start_run(check_workdir(str(tmp_path), _settings()), _config().data)
    assert read_marker(str(tmp_path)) == marker  # a run's identity is kept on resume


def test_the_checkpoint_gives_back_the_runs_config(tmp_path):
    assert Workdir(str(tmp_path)).saved_config() is None
    saved = _config(**{"optimizer.learning_rate": 0.25})
    _checkpoint(tmp_path, saved)
    assert config_from_dict(Workdir(str(tmp_path)).saved_config()) == saved


def test_an_imported_checkpoint_fixes_only_the_model(tmp_path):
    saved = _config()
    _checkpoint(tmp_path, saved, step=0, imported={"preset": "p"})
    state = check_workdir(str(tmp_path), _settings(**{"optimizer.learning_rate": 0.5}))
    assert state.imported
    with pytest.raises(WorkdirError, match="model.hidden_dim"):
        check_workdir(str(tmp_path), _settings(**{"model.hidden_dim": 32,
                                                  "model.num_query_heads": 4}))


def _sentencepiece(module):
    """A 200-piece tokenizer trained on a standard-library module's source."""
    with open(module.__file__, encoding="utf-8") as f:
        return SentencePieceTokenizer(train_sentencepiece([f.read()], 200), "tokenizer.model")


def test_a_replaced_tokenizer_of_the_same_size_is_noticed(tmp_path):
    import json as json_module
    import shutil
    ours, other = _sentencepiece(json_module), _sentencepiece(shutil)
    assert other.vocab_size == ours.vocab_size == 200
    _checkpoint(tmp_path, _config(), tokenizer=tokenizer_fingerprint(ours))
    state = check_workdir(str(tmp_path), _settings())
    check_tokenizer(state, ours)
    for replaced in (other, ByteTokenizer(), None):
        with pytest.raises(WorkdirError, match="the tokenizer differs from the one the run "
                                               "was trained with"):
            check_tokenizer(state, replaced)


# ---- tfllm import's leftover ----------------------------------------------------------------
def test_an_importing_folder_is_removed_only_when_a_crashed_import_left_it(tmp_path):
    leftover = tmp_path / "run.importing"
    leftover.mkdir()
    (leftover / "mine.txt").write_text("mine")
    with pytest.raises(PretrainedError, match=r"run.importing exists and is not a crashed "
                                              rf"tfllm import \(it has no {MARKER}"):
        import_preset(str(tmp_path / "no-preset"), str(tmp_path / "run"))
    assert (leftover / "mine.txt").read_text() == "mine"
    (leftover / MARKER).write_text(json.dumps({"tfllm": "run", "kind": "import"}))
    with pytest.raises(PretrainedError):  # the preset is missing; the leftover went first
        import_preset(str(tmp_path / "no-preset"), str(tmp_path / "run"))
    assert not leftover.exists()


# ---- the Workdir object ---------------------------------------------------------------------
def test_the_workdir_names_every_file_a_run_keeps(tmp_path):
    run = Workdir(str(tmp_path))
    paths = (run.checkpoints, run.config_file, run.metrics_file, run.tensorboard_dir,
             run.plot_file, run.costs_file, run.tokenizer_dir, run.pretrained_file,
             run.chat_template_file, run.trackers_file,
             run.reference_file, run.marker_file, run.logs_dir)
    assert all(os.path.dirname(p) == str(tmp_path) for p in paths)
    names = {os.path.basename(p) for p in paths}
    assert set(RUN_OUTPUTS) | {MARKER, "checkpoints", "logs"} == names


def test_the_weights_restore_alone_from_a_checkpoint_of_the_whole_run(tmp_path, source_run):
    """What generate, eval and the exports do: a model without optimizer state, on one
    device, restored from a checkpoint that also holds AdamW's moments and the loss scale."""
    parallel, variables, values = source_run
    run = Workdir(str(tmp_path / "run"))
    model = build_model(*sections(tiny_config("gpt")))
    with pytest.raises(FileNotFoundError, match="checkpoints holds no committed checkpoint"):
        run.restore_weights(model)
    run.checkpointer(parallel).save(4, variables, {"note": "whole run"})
    assert any(n.startswith("optimizer/m/") for n in variables)  # more than the weights
    assert run.restore_weights(model)["step"] == 4
    weights = model_variables(model)
    assert_same(gathered(weights), {name: values[name] for name in weights})
    assert run.restore_weights(model, step=4)["note"] == "whole run"

