"""Issue 48 item 6: what the user names on the command line, and what a failed write says.

A full disk names the path it could not write (an export's --out, TensorBoard's folder, a
run output's atomic write), an export into a link to an empty folder lands in that folder,
another rank's doctor report that is no JSON object counts as missing (no traceback)."""

import errno
import json
import os

import pytest

from tfllm import files
from tfllm.cli.main import main
from tfllm.contracts import IO_ERROR_EXIT_CODE


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_during_an_atomic_write_names_the_file_and_leaves_nothing(
        tmp_path, monkeypatch):
    # costs.json: ENOSPC named no path and left costs.json.part
    from tfllm.checkpoint.workdir import Workdir
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(OSError) as e:
        Workdir(str(tmp_path)).write_costs({"steps": 1})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "costs.json")
    assert os.listdir(tmp_path) == []


def test_a_full_disk_during_a_copy_names_the_copy(tmp_path, monkeypatch):
    (tmp_path / "src").write_text("x" * 100)
    monkeypatch.setattr("shutil.copyfileobj", _disk_full)
    with pytest.raises(OSError) as e:
        files.copy_file(str(tmp_path / "out"), str(tmp_path / "src"), "dst")
    assert e.value.filename == str(tmp_path / "out" / "dst")


@pytest.mark.parametrize("argv,where", [
    (["export", "--workdir", "/runs/a", "--out", "/exports/b"], "(writing under --out "
                                                               "/exports/b)"),
    (["train", "--workdir", "/runs/a"], "(writing under /runs/a)"),
])
def test_a_write_that_names_no_path_names_the_folder_the_command_writes(
        monkeypatch, capsys, argv, where):
    # ENOSPC during an export named the workdir, not --out
    monkeypatch.setattr(f"tfllm.cli.main.cmd_{argv[0]}", _disk_full)
    assert main(argv) == IO_ERROR_EXIT_CODE
    line = capsys.readouterr().err.strip()
    assert where in line and "\n" not in line
    if argv[0] == "export":
        assert "/runs/a" not in line


def test_an_out_that_links_to_an_empty_folder_is_that_folder(tmp_path):
    (tmp_path / "scratch").mkdir()
    os.symlink(tmp_path / "scratch", tmp_path / "out")
    out = files.require_new_folder(str(tmp_path / "out"))
    assert out == str(tmp_path / "scratch")
    with files.written_atomically(out) as tmp:
        files.write_atomically(tmp, "config.json", "{}")
    assert os.listdir(tmp_path / "scratch") == ["config.json"]
    assert os.path.islink(tmp_path / "out")  # the user's link, kept
    with pytest.raises(ValueError, match="exists and is not empty"):  # no longer empty
        files.require_new_folder(str(tmp_path / "out"))


def test_tensorboard_on_a_full_disk_names_its_folder(tmp_path, monkeypatch):
    import tensorflow as tf
    from tfllm.train.tensorboard import TensorBoard

    def refuse(logdir):
        raise tf.errors.ResourceExhaustedError(
            None, None, f"{logdir}/events.out.tfevents.1; No space left on device\n\t"
                        "Flushing first event.\n\tCould not initialize events writer.")
    monkeypatch.setattr(tf.summary, "create_file_writer", refuse)
    with pytest.raises(OSError) as e:
        TensorBoard(str(tmp_path / "tensorboard"))
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "tensorboard")


@pytest.mark.parametrize("content", ["[1, 2]", "5", '"report"', "[" * 100000])
def test_a_doctor_report_that_is_no_json_object_counts_as_missing(tmp_path, content):
    from tfllm.launch import doctor
    (tmp_path / doctor.REPORT.format(1)).write_text(content)
    (tmp_path / doctor.REPORT.format(0)).write_text(json.dumps({"rank": 0}))
    reports = doctor.wait_reports(str(tmp_path), 2, timeout_s=0.0)
    assert reports == {0: {"rank": 0}}
