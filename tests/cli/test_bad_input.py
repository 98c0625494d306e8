"""Bad input through the real `tfllm` command: one row per case.

A row is (argv, setup, exit code, message fragment). In argv `{run}` is a fresh copy of a
trained run (a sentencepiece tokenizer, committed checkpoints of steps 1 and 2) and `{tmp}`
the test's own folder; `setup(tmp, run, monkeypatch)` prepares the bad input first. Every
row checks what the docs promise (docs/checkpoints.md, "Exit codes"):

- the exit code (2: bad input, nothing written; 74: the storage failed, the latest
  committed checkpoint intact; 75: stopped by a signal; 130: a second signal);
- stderr is ONE line that starts `tfllm COMMAND: ` and names the input (the fragment);
- nothing the user had is lost or changed: with 2 every file under `{tmp}` is as it was
  and none is added; with 74, 75 and 130 every committed checkpoint is as it was and
  the latest stays the latest.

Rows run `tfllm.cli.main.main` in this process (most fail before TensorFlow is needed,
in milliseconds); the few that need a process of their own (a signal, TensorFlow's
start-up logs) are `PROCESS_ROWS`, run as `python -m tfllm.cli.main`. To add a case, add a
row; a case that still fails for a known reason gets `marks=_pending("why")`.
"""

import errno
import functools
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile

import h5py
import numpy as np
import pytest
import safetensors.numpy as safetensors

from tests.harness import (ROOT, TF_HANG_S, kill_group, snapshot_tree, start_process,
                           tfllm_command, wait_delivered, write_text_corpus)
from tests.pretrained import helpers
from tfllm.checkpoint import storage
from tfllm.cli.main import main
from tfllm.data.tokenizer import train_sentencepiece
from tfllm.train import metrics

BAD_INPUT, IO_ERROR, PREEMPTED, HARD_STOP = 2, 74, 75, 130
#: the trained run: 2 steps, a checkpoint after each, a 128-piece sentencepiece tokenizer
RUN_SETTINGS = {
    "model.vocab_size": 128, "model.hidden_dim": 32, "model.num_layers": 1,
    "model.num_query_heads": 2, "model.intermediate_dim": 64,
    "model.max_sequence_length": 32, "data.sequence_length": 16,
    "train.global_batch_size": 4, "train.steps": 2, "optimizer.warmup_steps": 1,
    "mesh.axes": "data=1", "data.source": "text", "data.tokenizer": "sentencepiece",
    "data.validation_fraction": 0.2, "train.eval_steps": 1, "train.eval_every": 0,
    "train.sample_tokens": 0, "train.log_every": 1, "checkpoint.every": 1,
    "train.xla_cache": "off", "train.jit_compile": "false",
}


def _sets(settings):
    return [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]


def _no_peak_measurement(patch):
    """MFU's CPU peak is measured by 2048^3 matmuls at each start (15 s on 2 free cores,
    minutes on a busy CI host); these runs print no MFU worth the time."""
    patch.setattr(metrics, "measure_matmul_peak", lambda **kwargs: 1e11)


@pytest.fixture(autouse=True)
def _fast_start(monkeypatch):
    _no_peak_measurement(monkeypatch)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("trained")
    pattern = write_text_corpus(base / "corpus")
    settings = dict(RUN_SETTINGS, **{"data.paths": f'["{pattern}"]',
                                     "data.data_dir": str(base / "cache")})
    with pytest.MonkeyPatch.context() as patch:
        _no_peak_measurement(patch)
        assert main(["train", "--workdir", str(base / "run"), *_sets(settings)]) == 0
    assert [s for s, _ in storage.committed(str(base / "run" / "checkpoints"))] == [1, 2]
    return base / "run"


# ---- setups: each makes one bad input ---------------------------------------------------------
def _write(relative, data):
    def setup(tmp, run, monkeypatch):
        path = tmp / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return setup


def _edit_run_config(old, new):
    def setup(tmp, run, monkeypatch):
        path = run / "config.yaml"
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new))
    return setup


def _flip_a_byte(relative):
    def setup(tmp, run, monkeypatch):
        path = run / relative
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF  # the first block: a model weight ('model/' sorts first)
        path.write_bytes(bytes(data))
    return setup


def _truncate(relative):
    def setup(tmp, run, monkeypatch):
        path = run / relative
        path.write_bytes(path.read_bytes()[:100])
    return setup


def _storage_fails(code):
    """Every checkpoint write fails with OSError `code` (a full disk, a quota, ...)."""
    def setup(tmp, run, monkeypatch):
        def write_client(tmp_dir, *args, **kwargs):
            path = os.path.join(tmp_dir, "client_00000", "shards.bin")
            raise OSError(code, os.strerror(code), path)
        monkeypatch.setattr(storage, "write_client", write_client)
    return setup


def _remove(relative):
    def setup(tmp, run, monkeypatch):
        shutil.rmtree(run / relative)
    return setup


def _delete(relative):
    def setup(tmp, run, monkeypatch):
        os.remove(run / relative)
    return setup


def _env(name, value):
    def setup(tmp, run, monkeypatch):
        monkeypatch.setenv(name, value)
    return setup


def _all(*setups):
    def setup(tmp, run, monkeypatch):
        for one in setups:
            one(tmp, run, monkeypatch)
    return setup


def _no_setup(tmp, run, monkeypatch):
    pass


@functools.lru_cache(maxsize=None)
def _other_sentencepiece() -> bytes:
    """A SentencePiece model of the run's size trained on other text."""
    words = "zebra quartz jumps over vexed fjord nymph waltz glyph crwth".split()
    return train_sentencepiece([" ".join(words[i:] + words[:i]) for i in range(10)] * 20,
                               RUN_SETTINGS["model.vocab_size"])


def _another_tokenizer(tmp, run, monkeypatch):
    """The run's tokenizer replaced by another of the same size."""
    (run / "tokenizer" / "tokenizer.model").write_bytes(_other_sentencepiece())


def _forge_manifest(name_for, payload=b"planted"):
    """Adds the manifest entry `name_for(tmp)` to the newest checkpoint, puts its payload
    where a reader that follows the name would read it, and recomputes the hash chain (as
    anyone who edits a checkpoint can): only the check of the name can refuse it."""
    def setup(tmp, run, monkeypatch):
        root = run / "checkpoints" / "step_00000002"
        name = name_for(tmp)
        target = os.path.normpath(os.path.join(root, name))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(payload)
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["files"][name] = {"sha256": hashlib.sha256(payload).hexdigest(),
                                   "bytes": len(payload)}
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        (root / "manifest.json").write_bytes(data)
        commit = json.loads((root / "COMMIT").read_text())
        commit["manifest_sha256"] = hashlib.sha256(data).hexdigest()
        (root / "COMMIT").write_text(json.dumps(commit))
    return setup


def _escaping_name(tmp):
    """A data-iterator file name that leads from the restore's temporary folder (made in
    tempfile.gettempdir()) to {tmp}/escaped: what a reader that follows it writes there
    makes the row fail (a file added under {tmp})."""
    return "client_00000/files/../" + os.path.relpath(os.path.join(tmp, "escaped"),
                                                      tempfile.gettempdir())


def _corpus(tmp, run, monkeypatch):
    write_text_corpus(tmp / "corpus")


def _hugging_face(change=None):
    """A small Llama 3 Hugging Face folder at {tmp}/hf (keras-hub's exporter), changed."""
    def setup(tmp, run, monkeypatch):
        helpers.save_huggingface("llama3", tmp / "hf")
        if change is not None:
            change(tmp / "hf")
    return setup


def _config_json(**changes):
    def change(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return change


def _weights(edit):
    def change(folder):
        weights = safetensors.load_file(str(folder / "model.safetensors"))
        edit(weights)
        safetensors.save_file(weights, str(folder / "model.safetensors"))
    return change


#: gpt2 saved once per module as a keras-hub preset and a Hugging Face folder
_SAVED = {}


@pytest.fixture(scope="module", autouse=True)
def _saved_models(tmp_path_factory):
    _SAVED["root"] = tmp_path_factory.mktemp("saved")
    yield
    _SAVED.clear()


def _gpt2(kind, change):
    """A gpt2 keras-hub preset ({tmp}/preset) or Hugging Face folder ({tmp}/hf), changed
    by `change(tmp, folder)`."""
    def setup(tmp, run, monkeypatch):
        if kind not in _SAVED:  # the first row that needs it saves it
            save = helpers.save_preset if kind == "preset" else helpers.save_huggingface
            save("gpt2", _SAVED["root"] / kind)
            _SAVED[kind] = _SAVED["root"] / kind
        shutil.copytree(_SAVED[kind], tmp / kind)
        change(tmp, tmp / kind)
    return setup


def _weights_outside(tmp, folder):
    """model.weights.h5 moved out of the preset folder, to {tmp}/outside.weights.h5."""
    outside = tmp / "outside.weights.h5"
    os.replace(folder / "model.weights.h5", outside)
    return outside


def _weight_map_outside(tmp, folder):
    """model.weights.json maps every weight to ../outside.weights.h5 (complete weights)."""
    outside = _weights_outside(tmp, folder)
    with h5py.File(outside, "r") as f:
        datasets = []
        f.visititems(lambda n, o: datasets.append(n) if isinstance(o, h5py.Dataset) else None)
    (folder / "model.weights.json").write_text(json.dumps(
        {"weight_map": {"/" + d.rsplit("/", 1)[0]: "../outside.weights.h5" for d in datasets}}))


def _weights_linked_outside(tmp, folder):
    os.symlink(_weights_outside(tmp, folder), folder / "model.weights.h5")


def _index_outside(tmp, folder):
    """model.safetensors.index.json maps every tensor to ../outside.safetensors."""
    outside = tmp / "outside.safetensors"
    os.replace(folder / "model.safetensors", outside)
    keys = list(safetensors.load_file(str(outside)))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "../outside.safetensors" for k in keys}}))


def _tokenizer_lambda(tmp, folder):
    """tokenizer.json a serialized Python function (marshalled bytecode)."""
    (folder / "tokenizer.json").write_text(json.dumps(
        {"class_name": "__lambda__", "config": {"value": "AAAA"}, "module": "builtins"}))


def _fifo(relative):
    """`relative` under {tmp} (a run's file: under {tmp}/run) made a FIFO: a reader that
    opens it as a file waits for a writer forever."""
    def setup(tmp, run, monkeypatch):
        path = tmp / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.unlink()
        os.mkfifo(path)
    return setup


def _symlink_loop(relative):
    def setup(tmp, run, monkeypatch):
        os.symlink(relative, tmp / relative)  # a link to itself
    return setup


#: 512 bytes that expand to 9**8 strings if aliases are followed (a "billion laughs")
_ALIAS_BOMB = "train: {a: &a [x, x, x, x, x, x, x, x, x]}\n" + "".join(
    f"x{i}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


def _forge_index(edit):
    """Applies `edit(variables)` to client 0's index.json of the newest checkpoint, then
    recomputes the hash chain (manifest, COMMIT) as anyone who edits a checkpoint can."""
    def setup(tmp, run, monkeypatch):
        root = run / "checkpoints" / "step_00000002"
        path = root / "client_00000" / "index.json"
        index = json.loads(path.read_text())
        edit(index["variables"])
        data = json.dumps(index).encode()
        path.write_bytes(data)
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["files"]["client_00000/index.json"] = {
            "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        text = json.dumps(manifest, indent=1, sort_keys=True).encode()
        (root / "manifest.json").write_bytes(text)
        commit = json.loads((root / "COMMIT").read_text())
        commit["manifest_sha256"] = hashlib.sha256(text).hexdigest()
        (root / "COMMIT").write_text(json.dumps(commit))
    return setup


def _first_weight(variables):
    return variables[sorted(n for n in variables if n.startswith("model/"))[0]]


def _overlapping_block(variables):
    entry = _first_weight(variables)
    entry["blocks"].append(dict(entry["blocks"][0]))


def _absurd_shape(variables):
    _first_weight(variables)["shape"][0] = 10 ** 20


def _metrics_fail(code):
    """Writing metrics.jsonl fails with OSError `code` and, as a write() does, no path."""
    def setup(tmp, run, monkeypatch):
        from tfllm.train import loop

        def record(self, record, model):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(loop._Outputs, "record", record)
    return setup


def _pending(why):
    """A row that fails today for a known reason outside this file: it must start to pass."""
    return pytest.mark.xfail(reason=why, strict=True)


GEN = ["generate", "--workdir", "{run}", "--prompt", "the cat"]
RESUME = ["train", "--workdir", "{run}"]
#: a new run on text files, byte-tokenized; one device and a batch of two (the input
#: pipeline has a stream per batch row: tiny's 16 took seconds per row that reaches it)
TEXT = ["train", "--workdir", "{tmp}/new", "--config", "configs/tiny.yaml", "--set",
        "data.source=text", "--set", "data.tokenizer=byte", "--set", "model.vocab_size=260",
        "--set", "data.data_dir={tmp}/cache", "--set", "train.xla_cache=off",
        "--set", "mesh.axes=data=1", "--set", "train.global_batch_size=2"]
CORPUS = ["--set", 'data.paths=["{tmp}/corpus/*.txt"]']
IMPORT = ["import", "--preset", "{tmp}/hf", "--workdir", "{tmp}/new"]
PRESET = ["import", "--preset", "{tmp}/preset", "--workdir", "{tmp}/imported"]
#: a new run in {tmp}/mine with the tiny config
MINE = ["train", "--workdir", "{tmp}/mine", "--config", "configs/tiny.yaml"]
#: settings whose values must be finite numbers
NONFINITE = [("optimizer.learning_rate", "inf"), ("optimizer.beta1", "nan"),
             ("optimizer.weight_decay", "nan"), ("model.norm_epsilon", "nan"),
             ("train.peer_timeout_s", "inf")]


ROWS = [
    # generate's arguments: refused by argparse, naming the flag, before anything is read
    pytest.param([*GEN, "--max-new-tokens", "0"], _no_setup, BAD_INPUT,
                 "argument --max-new-tokens: must be at least 1, got 0", id="max-new-tokens-0"),
    pytest.param([*GEN, "--temperature", "-1"], _no_setup, BAD_INPUT,
                 "argument --temperature: must be a number >= 0", id="temperature-negative"),
    pytest.param([*GEN, "--temperature", "nan"], _no_setup, BAD_INPUT,
                 "argument --temperature", id="temperature-nan"),
    pytest.param([*GEN, "--top-p", "0"], _no_setup, BAD_INPUT,
                 "argument --top-p: must be a number > 0 and <= 1, got 0", id="top-p-0"),
    pytest.param([*GEN, "--top-p", "1.5"], _no_setup, BAD_INPUT, "argument --top-p",
                 id="top-p-above-1"),
    pytest.param([*GEN, "--top-k", "-1"], _no_setup, BAD_INPUT, "argument --top-k",
                 id="top-k-negative"),
    pytest.param([*GEN, "--seed", str(2 ** 40)], _no_setup, BAD_INPUT, "argument --seed",
                 id="seed-beyond-32-bits"),
    pytest.param([*GEN, "--max-new-tokens", "many"], _no_setup, BAD_INPUT,
                 "argument --max-new-tokens: 'many' is not a whole number", id="not-a-number"),
    pytest.param(["generate", "--workdir", "{run}", "--prompt", ""], _no_setup, BAD_INPUT,
                 "argument --prompt: is empty", id="empty-prompt"),
    # other commands' arguments
    pytest.param(["eval", "--workdir", "{run}", "--steps", "-1"], _no_setup, BAD_INPUT,
                 "argument --steps: must be at least 0, got -1", id="eval-steps-negative"),
    pytest.param(["bench", "--config", "configs/tiny.yaml", "--steps", "0"], _no_setup,
                 BAD_INPUT, "argument --steps: must be at least 1, got 0", id="bench-steps-0"),
    pytest.param(["bench", "--config", "configs/tiny.yaml", "--repeats", "0"], _no_setup,
                 BAD_INPUT, "argument --repeats", id="bench-repeats-0"),
    pytest.param(["layouts", "--config", "configs/tiny.yaml", "--num-devices", "0"],
                 _no_setup, BAD_INPUT, "argument --num-devices", id="layouts-devices-0"),
    pytest.param(["plan", "--config", "configs/tiny.yaml", "--devices", "-2"], _no_setup,
                 BAD_INPUT, "argument --devices", id="plan-devices-negative"),
    pytest.param(["train", "--bogus"], _no_setup, BAD_INPUT, "unrecognized arguments: --bogus",
                 id="unknown-flag"),
    # --config and --set
    pytest.param(["train", "--workdir", "{tmp}/new", "--config", "{tmp}/latin1.yaml"],
                 _write("latin1.yaml", b"train:\n  steps: 3  # caf\xe9\n"), BAD_INPUT,
                 "latin1.yaml: not UTF-8", id="config-not-utf8"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--config", "{tmp}/bad.yaml"],
                 _write("bad.yaml", "train: [steps: 3\n"), BAD_INPUT,
                 "bad.yaml: not valid YAML", id="config-not-yaml"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--config", "{tmp}/nope.yaml"],
                 _no_setup, BAD_INPUT, "nope.yaml: no such file", id="config-missing"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", "model.hiden_dim=3"], _no_setup,
                 BAD_INPUT, "Did you mean 'model.hidden_dim'", id="unknown-key"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", "model.attention=cudnn"],
                 _no_setup, BAD_INPUT, "model.attention=cudnn: TensorFlow 2.21's DTensor "
                 "cannot run cuDNN's fused attention", id="attention-cudnn"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", "optimizer.learning_rate=nan"],
                 _no_setup, BAD_INPUT, "optimizer.learning_rate", id="learning-rate-nan"),
    *[pytest.param(["train", "--workdir", "{tmp}/new", "--set", f"{key}={value}"], _no_setup,
                   BAD_INPUT, f"{key}: '{value}' is not a finite number",
                   id=f"{key.split('.')[1]}-{value}") for key, value in NONFINITE],
    # the workdir
    pytest.param(["generate", "--workdir", "{tmp}/nothing", "--prompt", "a"], _no_setup,
                 BAD_INPUT, "nothing/config.yaml does not exist", id="not-a-run"),
    pytest.param(["train", "--workdir", "{tmp}/mine"], _write("mine/notes.txt", "mine"),
                 BAD_INPUT, "notes.txt", id="workdir-with-user-files"),
    pytest.param([*RESUME, "--set", "data.sequence_length=8"], _no_setup, BAD_INPUT,
                 "data.sequence_length", id="resume-with-other-data-settings"),
    pytest.param(["train", "--workdir", "{tmp}/afile"], _write("afile", "mine"), BAD_INPUT,
                 "is a file, not a directory", id="workdir-is-a-file"),
    pytest.param(MINE, _all(_write("mine/config.yaml", "train:\n  steps: 3\n"),
                            _write("mine/metrics.jsonl", '{"step": 1}\n'),
                            _write("mine/tensorboard/ev", b"mine")),
                 BAD_INPUT, "without the .tfllm-run marker of a tfllm run",
                 id="workdir-with-tfllm-names-but-no-marker"),
    pytest.param(MINE, _all(_write("mine/.tfllm-run", '{"tfllm": "run", "kind": "train"}'),
                            _write("mine/metrics.jsonl", '{"step": 1}\n'),
                            _write("mine/notes.txt", "mine")),
                 BAD_INPUT, "holds notes.txt, which tfllm did not write",
                 id="dead-run-with-user-files"),
    pytest.param(IMPORT, _all(_hugging_face(), _write("new.importing/mine.txt", "mine")),
                 BAD_INPUT, "new.importing exists and is not a crashed tfllm import",
                 id="import-beside-a-foreign-importing-folder"),
    pytest.param(RESUME, _edit_run_config("seed: 1234", "seed: 7"), BAD_INPUT,
                 "data.seed: 1234 there, 7 now", id="resume-with-another-seed"),
    # config.yaml deleted: the checkpoint's own config defines the run
    pytest.param([*RESUME, "--set", "optimizer.learning_rate=0.5"], _delete("config.yaml"),
                 BAD_INPUT, "holds a different run (", id="resume-without-config-yaml"),
    pytest.param(RESUME, _another_tokenizer, BAD_INPUT,
                 "the tokenizer differs from the one the run was trained with",
                 id="resume-with-another-tokenizer"),
    pytest.param(GEN, _another_tokenizer, BAD_INPUT,
                 "the tokenizer differs from the one the run was trained with",
                 id="generate-with-another-tokenizer"),
    # the run's own files
    pytest.param(GEN, _edit_run_config("source: text", "source: synthetic"), BAD_INPUT,
                 "data.source=synthetic and has no tokenizer", id="generate-without-tokenizer"),
    pytest.param([*GEN[:-1], "the dog ran to the park " * 10], _no_setup, BAD_INPUT,
                 "--prompt is",
                 id="prompt-too-long"),
    pytest.param(["eval", "--workdir", "{run}"], _remove("checkpoints"), BAD_INPUT,
                 "holds no committed checkpoint", id="eval-without-checkpoint"),
    pytest.param(["eval", "--workdir", "{run}"],
                 _flip_a_byte("checkpoints/step_00000002/client_00000/shards.bin"), BAD_INPUT,
                 "shards.bin", id="checkpoint-altered"),
    pytest.param(["eval", "--workdir", "{run}"],
                 _truncate("checkpoints/step_00000002/client_00000/shards.bin"), BAD_INPUT,
                 "shards.bin", id="checkpoint-truncated"),
    pytest.param([*RESUME, "--set", "train.steps=3"],
                 _flip_a_byte("checkpoints/step_00000002/client_00000/shards.bin"), BAD_INPUT,
                 "shards.bin", id="resume-from-altered-checkpoint"),
    pytest.param(["eval", "--workdir", "{run}"],
                 _edit_run_config("validation_fraction: 0.2", "validation_fraction: 0.0"),
                 BAD_INPUT, "no validation data (data.validation_fraction=0 and no "
                 "data.eval_paths)", id="eval-without-validation-data"),
    # crafted checkpoints: names that lead out, a missing signature
    pytest.param(RESUME, _forge_manifest(_escaping_name), BAD_INPUT,
                 "is not a relative path inside its directory", id="checkpoint-name-dotdot"),
    pytest.param(RESUME, _forge_manifest(
        lambda tmp: "client_00000/files/" + str(tmp / "escaped")), BAD_INPUT,
        "is not a relative path inside its directory", id="checkpoint-name-absolute"),
    pytest.param(["eval", "--workdir", "{run}"], _env("TFLLM_CHECKPOINT_KEY", "secret"),
                 BAD_INPUT, "not signed, but TFLLM_CHECKPOINT_KEY is set",
                 id="checkpoint-unsigned-with-key"),
    pytest.param(GEN, _write("run/tokenizer/tokenizer.model", b"not a sentencepiece model"),
                 BAD_INPUT, "tokenizer.model", id="corrupt-workdir-tokenizer"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", "data.tokenizer=file",
                  "--set", "data.tokenizer_path={tmp}/folder"],
                 _write("folder/readme.txt", "not a preset"), BAD_INPUT,
                 "data.tokenizer_path", id="tokenizer-folder-not-a-preset"),
    # data (docs/training.md, "Training on your own text files")
    pytest.param([*TEXT, "--set", 'data.paths=["{tmp}/none/*.txt"]'], _no_setup, BAD_INPUT,
                 "matches no files", id="data-pattern-matches-nothing"),
    pytest.param([*TEXT, *CORPUS], _write("corpus/empty.txt", ""), BAD_INPUT,
                 "empty.txt is empty", id="data-empty-file"),
    pytest.param([*TEXT, *CORPUS], _write("corpus/latin1.txt", b"caf\xe9 au lait"), BAD_INPUT,
                 "latin1.txt is not UTF-8 at byte offset 3", id="data-not-utf8"),
    pytest.param([*TEXT, *CORPUS, "--set", "train.global_batch_size=4"],
                 _write("corpus/one.txt", "one short document"), BAD_INPUT,
                 "lower train.global_batch_size", id="data-too-few-documents"),
    pytest.param([*TEXT, *CORPUS, "--set", "data.validation_fraction=0.0001"], _corpus,
                 BAD_INPUT, "data.validation_fraction=0.0001 held out no document",
                 id="validation-data-without-text"),
    pytest.param([*TEXT, *CORPUS, "--set", "train.sample_tokens=4",
                  "--set", "train.sample_prompt=" + "x" * 200], _corpus, BAD_INPUT,
                 "train.sample_prompt is 200 tokens, model.max_sequence_length is 128",
                 id="sample-prompt-too-long"),
    pytest.param([*TEXT, *CORPUS, "--set", 'data.eval_paths=["{tmp}/val.txt"]'],
                 _all(_corpus, _write("val.txt", "\n<|endoftext|>\n")), BAD_INPUT,
                 "give no documents", id="eval-paths-without-text"),
    pytest.param([*TEXT, *CORPUS, "--set", "model.vocab_size=128"], _corpus, BAD_INPUT,
                 "set model.vocab_size=257 or more", id="tokenizer-larger-than-vocab"),
    pytest.param([*TEXT, *CORPUS, "--set", "data.sequence_length=256"], _corpus, BAD_INPUT,
                 "data.sequence_length (256) exceeds model.max_sequence_length (128)",
                 id="sequence-longer-than-model"),
    pytest.param([*TEXT, *CORPUS, "--set", "data.tokenizer=file", "--set",
                  "data.tokenizer_path={tmp}/missing.model"], _corpus, BAD_INPUT,
                 "missing.model: no such file", id="tokenizer-missing"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--config", "configs/tiny.yaml",
                  "--set", "data.source=tfds", "--set", "data.tfds_name=lm1bb",
                  "--set", "data.tfds_data_dir={tmp}/tfds", "--set", "train.xla_cache=off"],
                 _no_setup, BAD_INPUT, "Did you mean 'lm1b'", id="tfds-unknown-name"),
    # tfllm import (docs/fine-tuning.md)
    pytest.param(IMPORT, _hugging_face(_config_json(model_type="gemma")), BAD_INPUT,
                 "GemmaBackbone is not an architecture tfllm can hold",
                 id="import-unknown-architecture"),
    pytest.param(IMPORT, _hugging_face(_weights(lambda w: w.pop("model.norm.weight"))),
                 BAD_INPUT, "tensor model.norm.weight", id="import-tensor-missing"),
    pytest.param(IMPORT, _hugging_face(_config_json(intermediate_size=128)), BAD_INPUT,
                 "but the model config needs [128, 32]", id="import-shape-mismatch"),
    pytest.param(IMPORT, _hugging_face(_weights(
        lambda w: w.update({"lm_head.weight": w["lm_head.weight"].astype(np.int8)}))),
        BAD_INPUT, "dtype int8", id="import-quantized-tensor"),
    pytest.param(["import", "--preset", "{tmp}/hf", "--workdir", "{run}"], _hugging_face(),
                 BAD_INPUT, "is not empty", id="import-into-a-non-empty-workdir"),
    # crafted presets: names and links that lead out of the folder, a tokenizer that is code
    pytest.param(PRESET, _gpt2("preset", _weight_map_outside), BAD_INPUT,
                 "'../outside.weights.h5' is not a plain file name",
                 id="preset-weight-map-dotdot"),
    pytest.param(PRESET, _gpt2("preset", _weights_linked_outside), BAD_INPUT,
                 "'model.weights.h5' resolves to", id="preset-weights-symlink"),
    pytest.param([*PRESET[:2], "{tmp}/hf", *PRESET[3:]], _gpt2("hf", _index_outside),
                 BAD_INPUT, "'../outside.safetensors'", id="hf-index-dotdot"),
    pytest.param(PRESET, _gpt2("preset", _tokenizer_lambda), BAD_INPUT,
                 "Requested the deserialization of a Python lambda",
                 id="preset-tokenizer-lambda"),
    # the storage fails while a checkpoint is written: the previous one stays the latest
    pytest.param([*RESUME, "--set", "train.steps=3"], _storage_fails(errno.ENOSPC), IO_ERROR,
                 "No space left on device", id="disk-full-sync-save"),
    pytest.param([*RESUME, "--set", "train.steps=3", "--set", "checkpoint.async_save=true"],
                 _storage_fails(errno.EACCES), IO_ERROR, "Permission denied",
                 id="permission-denied-async-save"),
    # the case: with asynchronous saves a full disk exited 2 ("bad input")
    pytest.param([*RESUME, "--set", "train.steps=3", "--set", "checkpoint.async_save=true"],
                 _storage_fails(errno.ENOSPC), IO_ERROR, "No space left on device",
                 id="disk-full-async-save"),
    # bounded input (issue 38): YAML that costs unbounded work, numbers beyond any range
    pytest.param(["train", "--workdir", "{tmp}/new", "--config", "{tmp}/bomb.yaml"],
                 _write("bomb.yaml", _ALIAS_BOMB), BAD_INPUT, "bomb.yaml: a YAML alias (*a)",
                 id="config-alias-bomb"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set",
                  "mesh.rules=[[batch, &x data], [embed, *x]]"], _no_setup, BAD_INPUT,
                 "--set mesh.rules: a YAML alias (*x)", id="set-alias"),
    pytest.param(RESUME, _write("run/config.yaml", _ALIAS_BOMB), BAD_INPUT,
                 "config.yaml: a YAML alias (*a)", id="run-config-alias-bomb"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--config", "{tmp}/deep.yaml"],
                 _write("deep.yaml", "[" * 20000 + "]" * 20000), BAD_INPUT,
                 "deep.yaml: nested deeper than", id="config-nested-20000-deep"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--config", "/dev/zero"], _no_setup,
                 BAD_INPUT, "/dev/zero: is a character device", id="config-is-a-device"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--config", "{tmp}/big.yaml"],
                 _write("big.yaml", "#" * (1 << 20) + "\n"), BAD_INPUT,
                 "more than a YAML config holds", id="config-too-large"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set",
                  "optimizer.learning_rate=" + "1" * 400], _no_setup, BAD_INPUT,
                 "(400 characters) is not a finite number", id="float-of-400-digits"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", "train.steps=" + "9" * 5000],
                 _no_setup, BAD_INPUT, "train.steps: expected an integer",
                 id="integer-of-5000-digits"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", "train.seed=" + "9" * 30],
                 _no_setup, BAD_INPUT, "train.seed: 999999999999999999999999999999 is out of "
                 "range", id="integer-beyond-int64"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", f"mesh.axes=data={10 ** 20}"],
                 _no_setup, BAD_INPUT, "a mesh holds at most 65536", id="mesh-sizes-1e20"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", "mesh.num_cpu_devices=1000000"],
                 _no_setup, BAD_INPUT, "mesh.num_cpu_devices: 1000000 is above the maximum",
                 id="num-cpu-devices-1e6"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", f"model.hidden_dim={10 ** 12}"],
                 _no_setup, BAD_INPUT, "model.hidden_dim: 1000000000000 is above the maximum",
                 id="hidden-dim-1e12"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--set", "model.hidden_dim=1000000",
                  "--set", "model.vocab_size=10000000"], _no_setup, BAD_INPUT,
                 "a tfllm model holds", id="model-beyond-the-config-limit"),
    pytest.param(["train", "--workdir", "{tmp}/new", "--config", "configs/tiny.yaml", "--set",
                  "mesh.device_type=CPU", "--set", "model.hidden_dim=262144"], _no_setup,
                 BAD_INPUT, "of float32 weights, more than this host's",
                 id="model-beyond-host-memory"),
    pytest.param([*GEN, "--set", "mesh.device_type=CPU"],
                 _edit_run_config("hidden_dim: 32", "hidden_dim: 262144"), BAD_INPUT,
                 "of float32 weights, more than this host's",
                 id="generate-model-beyond-host-memory"),
    # file inputs that are no regular file, or too large
    pytest.param([*TEXT, *CORPUS, "--set", "data.tokenizer=file", "--set",
                  "data.tokenizer_path=/dev/zero"], _corpus, BAD_INPUT,
                 "/dev/zero: is a character device", id="tokenizer-is-dev-zero"),
    pytest.param([*TEXT, *CORPUS, "--set", "data.tokenizer=file", "--set",
                  "data.tokenizer_path={tmp}/pipe.model"], _all(_corpus, _fifo("pipe.model")),
                 BAD_INPUT, "pipe.model: is a FIFO", id="tokenizer-is-a-fifo"),
    pytest.param([*TEXT, "--set", 'data.paths=["{tmp}/pipe.txt"]'], _fifo("pipe.txt"),
                 BAD_INPUT, "pipe.txt, which is no regular file", id="data-file-is-a-fifo"),
    pytest.param(["eval", "--workdir", "{run}"],
                 _fifo("run/checkpoints/step_00000002/metadata.json"), BAD_INPUT,
                 "metadata.json: is a FIFO", id="checkpoint-metadata-is-a-fifo"),
    pytest.param(["eval", "--workdir", "{run}"], _forge_index(_overlapping_block), BAD_INPUT,
                 "overlap", id="checkpoint-blocks-overlap"),
    pytest.param(["eval", "--workdir", "{run}"], _forge_index(_absurd_shape), BAD_INPUT,
                 "the blocks cover", id="checkpoint-absurd-shape"),
    pytest.param(IMPORT, _hugging_face(_config_json(vocab_size=10 ** 15)), BAD_INPUT,
                 "config.json: model.vocab_size: 1000000000000000 is above the maximum",
                 id="import-absurd-sizes"),
    pytest.param(IMPORT, _hugging_face(_weights(
        lambda w: w["model.norm.weight"].__setitem__(0, np.nan))), BAD_INPUT,
        "[model.norm.weight] (sequence_output_layernorm/scale): holds NaN",
        id="import-nan-weights"),
    pytest.param(IMPORT, _hugging_face(_weights(
        lambda w: w["lm_head.weight"].__setitem__((0, 0), np.inf))), BAD_INPUT,
        "[lm_head.weight] (token_embedding/reverse_embeddings): holds NaN or infinite",
        id="import-infinite-weights"),
    # errors that were no line or two (issue 38)
    pytest.param(["train", "--workdir", "{tmp}/" + "x" * 300, "--config", "configs/tiny.yaml"],
                 _no_setup, BAD_INPUT, "File name too long", id="workdir-name-too-long"),
    pytest.param(["train", "--workdir", "{tmp}/loop/run", "--config", "configs/tiny.yaml"],
                 _symlink_loop("loop"), BAD_INPUT, "Too many levels of symbolic links",
                 id="workdir-symlink-loop"),
    pytest.param([*GEN[:-1], "caf\udce9"], _no_setup, BAD_INPUT,
                 "argument --prompt: is not UTF-8 text", id="prompt-not-utf8"),
    pytest.param(["launch", "--bogus"], _no_setup, BAD_INPUT, "unknown argument '--bogus'",
                 id="launch-unknown-flag"),
    pytest.param([*RESUME, "--set", "train.steps=3"], _metrics_fail(errno.ENOSPC), IO_ERROR,
                 "No space left on device (writing under", id="disk-full-writing-metrics"),
]


def _resolve(argv, tmp, run):
    return [a.replace("{run}", str(run)).replace("{tmp}", str(tmp)) for a in argv]



def _committed(run):
    """{step: snapshot} of the run's committed checkpoints."""
    return {step: snapshot_tree(path)
            for step, path in storage.committed(str(run / "checkpoints"))}


def _prepare(tmp_path, trained_run, setup, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, symlinks=True)
    setup(tmp_path, run, monkeypatch)
    return run


def _check(code, err, expected_code, fragment, command, tmp_path, run, before, committed):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == expected_code, err
    assert len(lines) == 1, f"not one line:\n{err}"
    assert lines[0].startswith(f"tfllm {command}: "), lines[0]
    assert fragment in lines[0], lines[0]
    if expected_code == BAD_INPUT:  # nothing was written, nothing was lost
        assert snapshot_tree(tmp_path) == before
    else:  # every committed checkpoint as it was, the latest still the latest
        assert _committed(run) == committed


@pytest.mark.parametrize("argv, setup, expected_code, fragment", ROWS)
def test_bad_input(argv, setup, expected_code, fragment, tmp_path, trained_run, monkeypatch,
                   capsys):
    monkeypatch.chdir(ROOT)  # configs/ paths as a user in the checkout types them
    run = _prepare(tmp_path, trained_run, setup, monkeypatch)
    before, committed = snapshot_tree(tmp_path), _committed(run)
    capsys.readouterr()
    code = main(_resolve(argv, tmp_path, run))
    _check(code, capsys.readouterr().err, expected_code, fragment, argv[0], tmp_path, run,
           before, committed)


@pytest.mark.slow  # trains through the command line (a resume: compiles and runs a step)
def test_a_resume_without_config_yaml_reads_the_checkpoints_config(tmp_path, trained_run,
                                                                   capsys):
    run = _prepare(tmp_path, trained_run, _delete("config.yaml"), None)
    assert main(["train", "--workdir", str(run), "--set", "train.steps=3"]) == 0, \
        capsys.readouterr().err
    assert "resuming after step 2" in capsys.readouterr().out
    assert [s for s, _ in storage.committed(str(run / "checkpoints"))][-1] == 3
    assert "steps: 3" in (run / "config.yaml").read_text()  # written again


def test_debug_adds_the_traceback(tmp_path, capsys):
    assert main(["--debug", "generate", "--workdir", str(tmp_path), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("tfllm generate: error: ")


# ---- rows that need a process of their own ------------------------------------------------------
def _command(storage_errno):
    """The `tfllm` command as a process; with checkpoint writes failing (an errno) and no
    CPU peak measurement when an errno is given (a run that trains)."""
    if storage_errno is None:
        return tfllm_command()
    return [sys.executable, "-c", (
        "import os, sys, tfllm, tfllm.quiet\n"
        "tfllm.quiet.install(tfllm.USER_TF_LOG_LEVEL)  # as `command()`: before TensorFlow\n"
        "import tfllm.checkpoint.storage as s, tfllm.train.metrics as m\n"
        "def write_client(tmp, *a, **k):\n"
        f"    raise OSError({storage_errno}, os.strerror({storage_errno}), tmp)\n"
        "s.write_client = write_client\n"
        "m.measure_matmul_peak = lambda **kwargs: 1e11  # see _no_peak_measurement\n"
        "from tfllm.cli.main import main\n"
        "sys.exit(main())\n")]


PROCESS_ROWS = [
    # TensorFlow starts (a mesh that does not fit the host's devices): its C++ start-up
    # lines are filtered, the message stays one line
    pytest.param(["bench", "--config", "configs/tiny.yaml", "--set", "mesh.axes=data=3"],
                 None, None, BAD_INPUT, "do not divide over mesh axis 'data' (size 3)",
                 id="tensorflow-started"),
    # SIGTERM, then the checkpoint it asks for cannot be written: still 75, the failure said
    pytest.param([*RESUME, "--set", "train.steps=400", "--set", "checkpoint.every=0"],
                 errno.ENOSPC, signal.SIGTERM,
                 PREEMPTED, "could not be saved", id="signal-then-disk-full"),
    # two SIGTERMs during set-up (after the mesh, before the first step): the second is
    # the promised immediate stop, 130, nothing saved (it was -SIGTERM before the loop)
    pytest.param([*RESUME, "--set", "train.steps=400"], None, (signal.SIGTERM, 2, "tfllm: "),
                 HARD_STOP, "stopped at once by a second signal (SIGTERM)",
                 id="two-signals-during-set-up"),
]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("argv, storage_errno, sig, expected_code, fragment", PROCESS_ROWS)
def test_bad_input_in_a_process(argv, storage_errno, sig, expected_code, fragment, tmp_path,
                                trained_run):
    run = _prepare(tmp_path, trained_run, _no_setup, None)
    before, committed = snapshot_tree(tmp_path), _committed(run)
    # TF_CPP_MIN_LOG_LEVEL unset, as for most users: the command's filter hides the noise
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = start_process([*_command(storage_errno), *_resolve(argv, tmp_path, run)], env)
    try:
        # a signal after the first step, or (signal, times, after which stdout line)
        sig, times, after = sig if isinstance(sig, tuple) else (sig, 1, "step ")
        if sig is not None:
            for line in proc.stdout:
                if line.startswith(after):
                    for _ in range(times):  # apart: two pending signals would merge
                        proc.send_signal(sig)
                        wait_delivered(proc, sig)
                    break
        _, err = proc.communicate(timeout=TF_HANG_S)  # bounds a hang only
    finally:
        kill_group(proc)
    _check(proc.returncode, err, expected_code, fragment, argv[0], tmp_path, run, before,
           committed)


def test_a_run_the_compile_cache_cannot_be_written_to_serves_generate(tmp_path, trained_run,
                                                                      monkeypatch, capsys):
    """The XLA compile cache is optional for reading a run: a workdir that refuses it (read
    only, full) still serves generate, with one warning line (issue 38; as root, chmod
    refuses nothing, so the cache's creation fails as a read-only file system fails it)."""
    from tfllm.runtime import environment

    def read_only(directory, environ=None):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), directory)
    monkeypatch.setattr(environment, "xla_cache", read_only)
    run = _prepare(tmp_path, trained_run, _no_setup, None)
    before = snapshot_tree(tmp_path)
    capsys.readouterr()
    code = main(["generate", "--workdir", str(run), "--prompt", "the cat", "--max-new-tokens",
                 "2", "--set", "train.xla_cache=auto"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tfllm generate: warning: no XLA compile "
                                                   "cache"), captured.err
    assert "Read-only file system" in lines[0] and captured.out.strip()
    assert snapshot_tree(tmp_path) == before
