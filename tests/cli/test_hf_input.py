"""Bad Hugging Face data through `tfllm train` (data.source=hf): exit 2, one line naming
the column, split or file and the fix, and no run folder left."""

import os

import pytest

from tfllm.cli.main import main

datasets = pytest.importorskip("datasets")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, and `datasets`' arrow cache in this test's folder."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _train(tmp_path, *extra):
    return main(["train", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                 "--workdir", str(tmp_path / "run"), "--set", "data.source=hf",
                 "--set", "data.tokenizer=byte", "--set", "model.vocab_size=257",
                 "--set", "data.sequence_length=32", "--set", "model.max_sequence_length=32",
                 "--set", "train.steps=2", "--set", "train.global_batch_size=2",
                 "--set", "mesh.axes=data=1", *extra])


@pytest.mark.parametrize("settings, says", [
    (("--set", "data.text_key=body"),
     "data.text_key=body: {parquet} has no column 'body' (it has ['text', 'n']); set "
     "data.text_key to the column holding the text"),
    (("--set", "data.text_key=n"),
     "data.text_key=n: column 'n' of {parquet} holds int64, not text (strings)"),
    (("--set", "data.hf_dataset={saved}", "--set", "data.hf_eval_split=test"),
     "data.hf_eval_split=test: data.hf_dataset={saved}[test] has no such split"),
    (("--set", "data.paths=[{notes}]"),
     "data.paths: {notes} is no parquet, JSON, CSV or arrow file (by its suffix"),
    (("--set", "data.format=prompt_completion", "--set", "train.loss_on=completion"),
     "data.format=prompt_completion: {parquet} has no column 'prompt' (it has ['text', "
     "'n']); rename the column"),
])
def test_bad_hf_data_is_one_line_and_leaves_no_run(tmp_path, capsys, settings, says):
    parquet, saved, notes = (str(tmp_path / "d.parquet"), str(tmp_path / "saved"),
                             str(tmp_path / "notes.txt"))
    rows = {"text": [f"def f{i}(x):\n    return {i}\n" for i in range(16)],
            "n": list(range(16))}
    datasets.Dataset.from_dict(rows).to_parquet(parquet)
    datasets.DatasetDict(train=datasets.Dataset.from_dict(rows)).save_to_disk(saved)
    open(notes, "w").write("plain text")
    names = dict(parquet=parquet, saved=saved, notes=notes)
    settings = [s.format(**names) for s in settings]
    if not any(s.startswith(("data.paths", "data.hf_dataset")) for s in settings):
        settings += ["--set", f"data.paths=[{parquet}]"]
    capsys.readouterr()
    code = _train(tmp_path, *settings)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says.format(**names) in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # trains through the command line (in this process), twice: ~40 s
def test_the_hf_recipes_train_from_parquet_and_from_a_saved_folder(tmp_path, capsys):
    """docs/training.md's first two data.source=hf commands, on a tiny model: parquet
    files of data.paths, and a save_to_disk folder with its train and test splits (the
    test split evaluated)."""
    rows = {"text": [f"def f{i}(x):\n    return {i} * x\n" for i in range(64)]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "d.parquet"))
    split = datasets.Dataset.from_dict(rows).train_test_split(test_size=8, seed=0)
    split.save_to_disk(str(tmp_path / "my_set"))
    assert _train(tmp_path / "pq", "--set", f"data.paths=[{tmp_path / 'd.parquet'}]") == 0
    assert (tmp_path / "pq" / "run" / "metrics.jsonl").exists()
    assert _train(tmp_path / "saved", "--set", f"data.hf_dataset={tmp_path / 'my_set'}",
                  "--set", "data.hf_split=train", "--set", "data.hf_eval_split=test") == 0
    with open(tmp_path / "saved" / "run" / "metrics.jsonl") as f:
        assert any("eval_loss" in line for line in f)
