"""Writes and deletes never follow a link out of the run (issue 38, class 2): a link
planted at one of tfllm's temporary names, or a checkpoint folder that is a link to
another run's, is refused or left alone; what it points to is never written or deleted."""

import os

import pytest

from tfllm import files
from tfllm.checkpoint import storage
from tfllm.cli.main import main
from tests.harness import tiny_overrides


def test_writing_through_a_planted_link_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    os.symlink(victim, tmp_path / "metrics.jsonl.tmp")
    with pytest.raises(files.Refused, match="is a symbolic link"):
        files.open_for_writing(str(tmp_path), "metrics.jsonl.tmp")
    with pytest.raises(files.Refused, match="is a symbolic link"):
        files.open_for_writing(str(tmp_path), "metrics.jsonl.tmp", "a", append=True)
    assert victim.read_text() == "mine"
    with files.open_for_writing(str(tmp_path), "new.txt") as f:  # a plain new file is fine
        f.write("x")


def test_a_linked_checkpoint_of_another_run_is_never_pruned_or_cleaned(tmp_path):
    other = tmp_path / "other" / "checkpoints" / "step_00000001"
    other.mkdir(parents=True)
    (other / "COMMIT").write_text("{}")
    (other / "uncommitted").mkdir()
    mine = tmp_path / "run" / "checkpoints"
    mine.mkdir(parents=True)
    os.symlink(other, mine / "step_00000001")
    os.symlink(other / "uncommitted", mine / "step_00000002")
    for n in (3, 4):
        (mine / f"step_{n:08d}").mkdir()
        (mine / f"step_{n:08d}" / "COMMIT").write_text("{}")
    assert [s for s, _ in storage.committed(str(mine))] == [3, 4]  # links are not ours
    assert storage.cleanup(str(mine)) == []
    assert storage.prune(str(mine), 1) == [str(mine / "step_00000003")]
    assert (other / "COMMIT").read_text() == "{}" and (other / "uncommitted").is_dir()
    assert os.path.islink(mine / "step_00000001")


@pytest.mark.slow  # two tiny trainings in this process: ~15-30 s
def test_a_resume_with_links_at_tfllm_s_temporary_names_writes_nothing_through_them(
        tmp_path, capsys):
    run = tmp_path / "run"
    sets = [a for o in tiny_overrides("gpt", **{"train.steps": 2}) for a in ("--set", o)]
    assert main(["train", "--workdir", str(run), *sets]) == 0
    victims = {}
    for name in ("metrics.jsonl.tmp", "config.yaml.tmp", "loss.png.tmp.png"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("mine")
        os.symlink(victim, run / name)
        victims[victim] = "mine"
    capsys.readouterr()
    code = main(["train", "--workdir", str(run), *sets, "--set", "train.steps=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is a symbolic link (to " in err[0], err
    assert "where tfllm writes its own files" in err[0]
    assert str(run) in err[0], err
    for victim, text in victims.items():
        assert victim.read_text() == text
