"""`tfllm eval --tasks` refusals: one line, exit code 2, before the weights are read (the
workdirs here hold a config.yaml and nothing else: no checkpoint is ever reached)."""

import pytest
import yaml

pytest.importorskip("lm_eval")

from tfllm.cli.main import main  # noqa: E402
from tfllm.config import load_config  # noqa: E402
from tfllm.config.loader import to_dict  # noqa: E402


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run = tmp_path / "run"
    run.mkdir()
    config = to_dict(load_config(None, ["data.tokenizer=byte", "model.vocab_size=257"]))
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def _refused(capsys, *args):
    code = main(["eval", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_a_missing_task_is_one_line(workdir, capsys, monkeypatch):
    # lm-eval's catalogue is indexed when the name is not tfllm's: skipped here (tens of
    # seconds), as if it had no such task either
    from tfllm.evals import benchmark
    monkeypatch.setattr(benchmark, "TaskManager", _no_catalogue(benchmark.TaskManager))
    err = _refused(capsys, "--workdir", str(workdir), "--tasks", "tfllm_tiny_mc,no_such_task")
    assert "--tasks no_such_task: no such task" in err


def _no_catalogue(cls):
    def manager(include_path=None, include_defaults=True, **kwargs):
        return cls(include_path=include_path, include_defaults=False, **kwargs)
    return manager


def test_a_missing_task_file_is_one_line(workdir, capsys, tmp_path):
    err = _refused(capsys, "--workdir", str(workdir), "--tasks", str(tmp_path / "gone.yaml"))
    assert "gone.yaml: no such task file" in err


def test_a_task_whose_data_file_is_missing_is_one_line(workdir, capsys, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "broken.yaml").write_text(
        "task: broken_data\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'missing.jsonl'}\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: q\ndoc_to_choice: ['a', 'b']\ndoc_to_target: 0\n")
    err = _refused(capsys, "--workdir", str(workdir), "--include-path", str(tasks),
                   "--tasks", "broken_data")
    assert "--tasks broken_data: a task could not be loaded" in err


def test_a_task_file_that_is_no_yaml_is_one_line(workdir, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    err = _refused(capsys, "--workdir", str(workdir), "--tasks", str(bad))
    assert "bad.yaml" in err


def test_an_include_path_that_is_no_folder_is_one_line(workdir, capsys, tmp_path):
    err = _refused(capsys, "--workdir", str(workdir), "--include-path",
                   str(tmp_path / "nowhere"), "--tasks", "tfllm_tiny_mc")
    assert "--include-path" in err and "not a folder" in err


def test_a_task_flag_without_tasks_is_one_line(workdir, capsys):
    err = _refused(capsys, "--workdir", str(workdir), "--num-fewshot", "3")
    assert "--num-fewshot goes with --tasks" in err
