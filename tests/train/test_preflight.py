"""Before the first step and after the last: bad input fails before the run writes into
its workdir, the final checkpoint is saved before anything after the last step can fail,
and a signal whose save fails still stops the run as preempted.

One-device tiny runs of one or two steps whose step computes nothing: the loop's order
is what is checked, without compiling a step.
"""

import errno
import hashlib
import io
import json
import os
import signal

import pytest

from tests.harness import tiny_config, tiny_text_config
from tfllm.config import ConfigError, load_config
from tfllm.data import DataError
from tfllm.data.sources import has_validation
from tfllm.train.loop import train
from tfllm.train.preemption import Preempted
from tfllm.train.run import Run
from tfllm.contracts import MARKER

# Two rows: every row of the batch is a data stream of its own, each traced anew.
ONE_DEVICE = {"model.num_layers": 1, "train.global_batch_size": 2, "train.log_every": 1,
              "train.eval_every": 0, "checkpoint.every": 0, "train.sample_tokens": 0,
              "train.progress": "lines"}


def _text_config(tmp_path, **extra):
    return tiny_text_config(tmp_path, "data=1", **{**ONE_DEVICE, **extra})


def _fail_evaluation(monkeypatch):
    def evaluate(self):
        raise RuntimeError("evaluation failed")
    monkeypatch.setattr(Run, "evaluate", evaluate)


class _StepWithoutCompute:
    """The run's train step with its batch placement, but no computation: what these
    tests check is the loop's order, and compiling a step would cost them many seconds
    on a busy 2-core CPU."""

    def __init__(self, step):
        self._step = step

    def __getattr__(self, name):  # placement, the skipped-step counter
        return getattr(self._step, name)

    def __call__(self, batch, loss_limit=None, fetch=True, reader=None):
        if self.on_call is not None:
            self.on_call()
        return {"loss": 1.0, "grad_norm": 1.0, "learning_rate": 0.0, "skipped_steps": 0,
                "step_ok": True}

    on_call = None


def _without_compute(monkeypatch, on_call=None):
    from tfllm.train import loop, metrics
    # The MFU display's matmul peak, timed on the CPU at every run: 2048^3 matmuls.
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda **kwargs: 1e12)
    real_run = loop.Run

    def run(*args, **kwargs):
        made = real_run(*args, **kwargs)
        made.step = _StepWithoutCompute(made.step)
        made.step.on_call = on_call
        return made
    monkeypatch.setattr(loop, "Run", run)


@pytest.mark.parametrize("workdir", ["new", "dead run"])
def test_an_empty_validation_split_fails_before_anything_is_written(tmp_path, workdir):
    # 0.001 of these 48 documents is none (each is held out by a hash of its text): the
    # issue's run trained every step, then failed its final evaluation.
    cfg = _text_config(tmp_path, **{"data.validation_fraction": 0.001, "train.steps": 1,
                                    "data.tokenizer": "sentencepiece",
                                    "model.vocab_size": 120})
    run = tmp_path / "run"
    if workdir == "dead run":  # a run that died before its first checkpoint
        (run / "tokenizer").mkdir(parents=True)
        (run / "tokenizer" / "tokenizer.model").write_bytes(b"the dead run's")
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        (run / MARKER).write_text('{"tfllm": "run", "kind": "train"}')
    before = sorted(p.relative_to(tmp_path) for p in run.rglob("*")) if run.exists() else None
    with pytest.raises(DataError) as e:
        train(cfg, str(run))
    message = str(e.value)
    assert message.startswith("the validation data holds no text") and "\n" not in message
    assert ("data.validation_fraction=0.001 held out no document" in message
            and "raise data.validation_fraction, name validation files (data.eval_paths)"
            in message and "data.validation_fraction=0" in message)
    assert "eval_steps" not in message  # fewer batches never help
    # Nothing written (no marker, no trained tokenizer), a dead run not yet cleared.
    after = sorted(p.relative_to(tmp_path) for p in run.rglob("*")) if run.exists() else None
    assert after == before
    if workdir == "dead run":
        assert (run / "tokenizer" / "tokenizer.model").read_bytes() == b"the dead run's"


def test_validation_files_without_text_fail_before_the_first_step(tmp_path):
    (tmp_path / "val.txt").write_text("\n<|endoftext|>\n")
    cfg = _text_config(tmp_path, **{"data.eval_paths": f'["{tmp_path / "val.txt"}"]'})
    with pytest.raises(DataError, match=r"data.eval_paths=\[.*val.txt'\] give no documents"):
        train(cfg, str(tmp_path / "run"))


def test_a_sample_prompt_too_long_for_the_model_fails_before_the_first_step(tmp_path):
    cfg = _text_config(tmp_path, **{"train.sample_tokens": 4, "train.sample_prompt": "x" * 40})
    with pytest.raises(ConfigError, match="train.sample_prompt is 40 tokens, model."
                                          "max_sequence_length is 32"):
        train(cfg, str(tmp_path / "run"))


def test_the_final_checkpoint_is_saved_before_the_final_evaluation(tmp_path, monkeypatch):
    cfg = tiny_config("gpt", "data=1", **{**ONE_DEVICE,
                                          "train.steps": 2})
    _fail_evaluation(monkeypatch)
    _without_compute(monkeypatch)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train(cfg, str(tmp_path))
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000002"]
    assert (tmp_path / "checkpoints" / "step_00000002" / "COMMIT").exists()


def test_a_new_run_trains_its_own_tokenizer_not_a_dead_runs_and_saves_it(tmp_path,
                                                                        monkeypatch):
    cfg = _text_config(tmp_path, **{"train.steps": 1, "data.tokenizer": "sentencepiece",
                                    "model.vocab_size": 120})
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer.model").write_bytes(b"the dead run's: not a model")
    (run / MARKER).write_text('{"tfllm": "run", "kind": "train"}')
    _without_compute(monkeypatch)
    train(cfg, str(run))
    saved = (run / "tokenizer" / "tokenizer.model").read_bytes()
    assert saved != b"the dead run's: not a model"
    meta = json.loads((run / "checkpoints" / "step_00000001" / "metadata.json").read_text())
    assert meta["tokenizer"] == "sentencepiece:" + hashlib.sha256(saved).hexdigest()


def test_a_signal_whose_save_fails_still_stops_as_preempted(tmp_path, monkeypatch):
    # Exit 75 (the signal is why the run stopped); the command reads the save's error
    # from the exception's cause and says it.
    from tfllm.checkpoint import Checkpointer

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Checkpointer, "save", full_disk)
    _without_compute(monkeypatch, on_call=lambda: os.kill(os.getpid(), signal.SIGTERM))
    cfg = tiny_config("gpt", "data=1", **{**ONE_DEVICE,
                                          "train.steps": 5})
    with pytest.raises(Preempted) as e:
        train(cfg, str(tmp_path))
    assert e.value.step == 1 and isinstance(e.value.__cause__, OSError)


def test_validation_fraction_0_means_no_evaluation(tmp_path, monkeypatch):
    # As Keras' validation_split=0: every document trains, nothing evaluates (neither
    # train.eval_every nor at the end), and the run says so.
    cfg = _text_config(tmp_path, **{"data.validation_fraction": 0, "train.eval_every": 1,
                                    "train.steps": 1})
    assert not has_validation(cfg.data)
    _fail_evaluation(monkeypatch)
    _without_compute(monkeypatch)
    out = io.StringIO()
    last = train(cfg, str(tmp_path / "run"), out=out)
    assert last["step"] == 1 and "eval_loss" not in last
    assert ("no validation data (data.validation_fraction=0 and no data.eval_paths): no "
            "evaluation") in out.getvalue()
    assert "eval_loss" not in (tmp_path / "run" / "metrics.jsonl").read_text()


@pytest.mark.parametrize("source, extra, expected", [
    ("corpus", {}, False), ("text", {"eval_paths": ["v.txt"]}, True),
    ("tfds", {"tfds_eval_split": "validation"}, True), ("tfds", {"tfds_eval_split": ""}, False),
    ("synthetic", {}, True)])
def test_which_settings_give_validation_data(source, extra, expected):
    cfg = load_config(None, ["data.validation_fraction=0", f"data.source={source}",
                             "data.paths=[x]", "data.tfds_name=lm1b"])
    for key, value in extra.items():
        setattr(cfg.data, key, value)
    assert has_validation(cfg.data) is expected
    cfg.data.validation_fraction = 0.1
    assert has_validation(cfg.data)


@pytest.mark.parametrize("source, message", [
    ("text", "no validation data (data.validation_fraction=0 and no data.eval_paths); set "
             "data.eval_paths or data.validation_fraction > 0."),
    ("corpus", "no validation data (data.validation_fraction=0); set "
               "data.validation_fraction > 0.")])
def test_asking_for_validation_data_there_is_none_of_is_one_line(source, message):
    # What `tfllm eval` meets on a run trained without validation data.
    from tfllm.data.sources import documents
    cfg = load_config(None, ["data.validation_fraction=0", f"data.source={source}",
                             "data.paths=[x]"])
    with pytest.raises(DataError) as e:
        documents(cfg.data, "validation")
    assert str(e.value) == message


def test_the_hash_split_of_the_test_corpus_holds_out_none_at_0_001(tmp_path):
    # The first test's premise, checked directly (fast): not one document held out.
    from tfllm.data.sources import documents
    cfg = _text_config(tmp_path, **{"data.validation_fraction": 0.001})
    assert list(documents(cfg.data, "validation").as_numpy_iterator()) == []


class _DeviceValue:
    """A metric left on the device by a step (`fetch=False`): `loop.to_numpy` is spied on
    to see when the loop fetches it."""

    def __init__(self, step, value):
        self.step, self.value = step, value


def _steps_with_lazy_metrics(monkeypatch, nan_at=None):
    from tfllm.train import loop
    ran, fetches = [], []

    def on_call():
        ran.append(len(ran) + 1)

    _without_compute(monkeypatch, on_call=on_call)
    real_call = _StepWithoutCompute.__call__

    def lazy(self, batch, loss_limit=None, fetch=True, reader=None):
        values = real_call(self, batch, loss_limit)
        step = ran[-1]
        if step == nan_at:
            values["loss"] = float("nan")
        assert not fetch  # the loop asks for device tensors, and fetches them itself
        return {k: _DeviceValue(step, v) for k, v in values.items()}

    def to_numpy(x):
        fetches.append((len(ran), x.step))  # (steps run so far, the step of the value)
        return x.value

    monkeypatch.setattr(_StepWithoutCompute, "__call__", lazy)
    monkeypatch.setattr(loop, "to_numpy", to_numpy)
    return fetches


def test_metrics_are_fetched_only_at_logged_steps(tmp_path, monkeypatch):
    # Fetching every step's metrics made the host wait for each step before preparing
    # the next batch: they stay on the devices until a logged step (here every 5th, the
    # first and the last) reads all those since the previous one, in order.
    cfg = _text_config(tmp_path, **{"train.steps": 12, "train.log_every": 5,
                                    "data.validation_fraction": 0})
    fetches = _steps_with_lazy_metrics(monkeypatch)
    train(cfg, str(tmp_path / "run"))
    assert sorted({at for at, _ in fetches}) == [1, 5, 10, 12]
    assert sorted({step for _, step in fetches}) == list(range(1, 13))  # each one, once
    assert len(fetches) == 12 * 5  # five metrics per step


def test_a_non_finite_loss_between_logged_steps_still_aborts_naming_its_step(tmp_path,
                                                                             monkeypatch):
    from tfllm.train.preemption import NonFiniteError
    cfg = _text_config(tmp_path, **{"train.steps": 12, "train.log_every": 5,
                                    "data.validation_fraction": 0, "checkpoint.every": 8})
    fetches = _steps_with_lazy_metrics(monkeypatch, nan_at=7)
    with pytest.raises(NonFiniteError, match="step 7: loss nan"):
        train(cfg, str(tmp_path / "run"))
    # Found at the save of step 8 (a save fetches first): nothing after it was saved.
    assert max(at for at, _ in fetches) == 8
    assert not os.path.exists(tmp_path / "run" / "checkpoints" / "step_00000008")


def test_run_training_refuses_a_run_beyond_this_host_before_making_anything(tmp_path):
    # The library makes the command's memory check (tfllm.train.preflight.check_memory),
    # before the workdir exists: a notebook's run_training gets the same one line.
    from tfllm.contracts import InputError
    config = tiny_config("gpt", **{"mesh.device_type": "CPU", "model.hidden_dim": 262144})
    with pytest.raises(InputError, match="of float32 weights, more than this host's"):
        train(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
