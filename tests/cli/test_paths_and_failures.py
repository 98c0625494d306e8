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


def _doctor_report(rank):
    return {"host": f"n{rank}", "rank": rank, "address": f"n{rank}", "tensorflow": "2.21.0",
            "cuda": None, "cudnn": None, "nccl": None, "driver": None, "gpus": [],
            "nccl_env": {}, "ports": {"9991": True}, "listening": [9991],
            "findings": [["ok", "no GPU"]]}


_NOT_REPORTS = ["[1, 2]", "5", '"report"', "[" * 100000, "{", json.dumps({"rank": 1}),
                json.dumps(dict(_doctor_report(1), findings={"a": 1})),
                json.dumps(dict(_doctor_report(1), findings=[["ok"]])),
                json.dumps(dict(_doctor_report(1), ports=[9991])),
                json.dumps(dict(_doctor_report(1), ports={"9991": "yes"})),
                json.dumps(dict(_doctor_report(1), rank=True)),
                json.dumps(dict(_doctor_report(1), gpus=[5])),
                json.dumps(dict(_doctor_report(1), listening=[70000])),
                json.dumps(dict(_doctor_report(1), tensorflow=2.21))]


@pytest.mark.parametrize("content", _NOT_REPORTS)
def test_a_doctor_report_that_is_no_report_is_named_not_waited_for(tmp_path, content):
    # Another rank's report is checked field by field (what the job's comparison reads)
    # before it is used: a list, a truncated object, a missing or mistyped field was a
    # traceback on rank 0 or a rank waited for until --wait-s ran out.
    from tfllm.doctor import job as doctor
    from tfllm.doctor.findings import compare
    (tmp_path / doctor.REPORT.format(1)).write_text(content)
    (tmp_path / doctor.REPORT.format(0)).write_text(json.dumps(_doctor_report(0)))
    invalid = {}
    reports = doctor.wait_reports(str(tmp_path), 2, timeout_s=600.0, invalid=invalid)
    assert list(reports) == [0] and list(invalid) == [1]  # returned at once, not at 600 s
    assert invalid[1].startswith(str(tmp_path / doctor.REPORT.format(1)) + ": ")
    assert "\n" not in invalid[1]
    found = compare(reports, 2, 600.0, invalid={1})
    assert not any("wrote no report" in f.message for f in found)  # named, not missing


def test_a_well_formed_doctor_report_passes_the_check():
    from tfllm.doctor import job as doctor
    assert doctor.report_problem(_doctor_report(3)) is None


# ---- paths on the command line -------------------------------------------------------------
def _path_options():
    """(command, option) of every option of every command."""
    from tfllm.cli.main import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.option_strings:
                yield name, action


def test_every_path_option_expands_the_home_folder(tmp_path, monkeypatch):
    from tfllm.cli.main import build_parser, user_path
    monkeypatch.setenv("HOME", str(tmp_path))
    import re
    named = re.compile(r"\b(directory|folder|file|path|dir)\b", re.I)
    paths = [(c, a) for c, a in _path_options()
             if a.nargs != 0 and not a.choices and a.dest not in ("max_shard_size", "ports")  # sizes, ports
             and (a.type is None or a.type is user_path)
             and (named.search(a.help or "") or named.search(a.metavar or ""))]
    assert {a.dest for _, a in paths} >= {"workdir", "out", "config", "preset", "tokenizer",
                                          "adapter", "report_dir", "plot"}
    for command, action in paths:
        assert action.type is user_path, f"tfllm {command} {action.option_strings[0]}"
    # `--workdir=~/r` reaches tfllm unexpanded (the shell expands only `--workdir ~/r`)
    args = build_parser().parse_args(["train", "--workdir=~/r"])
    assert args.workdir == str(tmp_path / "r")


@pytest.mark.parametrize("make,expected", [
    (lambda tmp: "~no-such-user-tfllm/r", "names no home folder on this host"),
    (lambda tmp: (os.symlink(tmp / "loop", tmp / "loop"), str(tmp / "loop" / "r"))[1],
     "Too many levels of symbolic links"),
    (lambda tmp: str(tmp) + "/caf\udce9", "not a UTF-8 name"),
    (lambda tmp: ((tmp / "file").write_text("x"), str(tmp / "file" / "r"))[1],
     "Not a directory"),
])
def test_a_workdir_the_system_refuses_is_one_line_before_any_work(
        tmp_path, capsys, make, expected):
    workdir = make(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert main(["train", "--workdir", workdir, "--set", "data.source=synthetic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --workdir" in err[0] and expected in err[0], err
    assert sorted(os.listdir(tmp_path)) == before  # nothing written


def test_a_path_in_the_config_expands_the_home_folder(tmp_path, monkeypatch):
    from tfllm.runtime.environment import xla_cache_dir
    monkeypatch.setenv("HOME", str(tmp_path))
    assert xla_cache_dir("~/cache", None) == str(tmp_path / "cache")


# ---- an export interrupted ---------------------------------------------------------------------
def test_the_next_export_removes_what_a_killed_export_left_and_names_the_rest(tmp_path):
    import socket
    with open("/proc/sys/kernel/pid_max") as f:
        gone = int(f.read()) + 1  # no process has it
    host = socket.gethostname()
    killed = tmp_path / f".out.exporting-{host}-{gone}-ab_12"
    (killed / "saved_model").mkdir(parents=True)
    alive = tmp_path / f".out.exporting-{host}-{os.getpid()}-cd34"  # still running
    alive.mkdir()
    old = tmp_path / ".out.exporting-x1y2z3"  # an earlier tfllm's name: whose, unknown
    old.mkdir()
    other = tmp_path / ".other.exporting-x1y2z3"  # another --out's: not looked at
    other.mkdir()
    said = []
    with files.written_atomically(str(tmp_path / "out"), said.append) as tmp:
        files.write_atomically(tmp, "config.yaml", "a: 1")
    assert not killed.exists() and alive.is_dir() and old.is_dir() and other.is_dir()
    removed = [line for line in said if f"removed {killed}," in line]
    named = [line for line in said if "is an export's temporary folder" in line]
    assert len(said) == 3 and len(removed) == 1 and len(named) == 2
    assert str(alive) in " ".join(named) and str(old) in " ".join(named)
    assert os.listdir(tmp_path / "out") == ["config.yaml"]


_SLOW_EXPORT = """
import sys, time
import tfllm.cli.main as cli
from tfllm import files
def slow(args):
    with files.written_atomically(files.require_new_folder(args.out)) as tmp:
        files.write_atomically(tmp, "model.weights.h5", b"x" * 1000)
        print("writing", flush=True)
        time.sleep(600)
cli.cmd_export = slow
sys.exit(cli.main(["export", "--workdir", sys.argv[1], "--out", sys.argv[2]]))
"""


@pytest.mark.slow  # a process of its own
@pytest.mark.multiprocess
def test_sigterm_during_an_export_leaves_no_temporary_folder(tmp_path):
    import signal
    from tests.harness import PY, finish, start_process
    from tfllm.contracts import HARD_STOP_EXIT_CODE
    (tmp_path / "exports").mkdir()
    proc = start_process([PY, "-c", _SLOW_EXPORT, str(tmp_path / "run"),
                          str(tmp_path / "exports" / "out")])
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert len(os.listdir(tmp_path / "exports")) == 1  # its temporary folder
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc, timeout=120)  # bounds a hang only
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == HARD_STOP_EXIT_CODE and "interrupted" in err, err
    assert os.listdir(tmp_path / "exports") == []


def test_a_profile_trace_on_a_full_disk_names_its_folder(tmp_path, monkeypatch):
    import tensorflow as tf
    from tfllm.train.profile import StepProfiler

    def full(*args, **kwargs):
        raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")
    monkeypatch.setattr(tf.profiler.experimental, "start", lambda *a, **k: None)
    monkeypatch.setattr(tf.profiler.experimental, "stop", full)
    profiler = StepProfiler(str(tmp_path / "tensorboard"))
    profiler.start()
    with pytest.raises(OSError) as e:
        profiler.stop()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "tensorboard")
    assert not profiler.active


def test_metrics_on_a_full_disk_name_metrics_jsonl(tmp_path, monkeypatch):
    from tfllm.train import loop

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    outputs = loop._Outputs.__new__(loop._Outputs)
    outputs.file, outputs.tensorboard = Full(), None
    outputs.metrics_path = str(tmp_path / "metrics.jsonl")
    with pytest.raises(OSError) as e:
        outputs.record({"step": 1, "loss": 1.0}, None)
    assert e.value.filename == str(tmp_path / "metrics.jsonl")


def test_the_config_s_paths_expand_the_home_folder(tmp_path, monkeypatch):
    # every path a config names: data.paths / eval_paths (globs), data.chat_template,
    # data.tokenizer_path, train.xla_cache (above); data.data_dir and data.tfds_data_dir
    # go through os.path.expanduser where read (tfllm/data/corpus.py, sources.py)
    from tfllm.config import Config
    from tfllm.data.chat_template import store_chat_template
    from tfllm.data.sources import resolve_files
    from tfllm.data.tokenizer import from_file
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "a.txt").write_text("text")
    assert resolve_files(["~/*.txt"], "data.paths") == [str(tmp_path / "a.txt")]
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    data = Config().data
    data.chat_template = "~/t.jinja"
    store_chat_template(data, str(tmp_path / "run"))
    assert (tmp_path / "run" / "chat_template.jinja").read_text() == "{{ messages }}"
    from tfllm.data.errors import DataError
    with pytest.raises(DataError, match=f"tokenizer_path={tmp_path}/missing.model: no such"):
        from_file("~/missing.model")  # looked for in the home folder


@pytest.mark.parametrize("module, name", [("tfllm.data.errors", "DataError"),
                                          ("tfllm.families", "PretrainedError"),
                                          ("tfllm.checkpoint.shards", "CheckpointError"),
                                          ("tfllm.config.loader", "ConfigError")])
def test_every_parsers_error_is_exit_2_in_one_line(module, name):
    # The parsers' fuzz tests (chat data, templates, adapters, checkpoints, configs) assert
    # their error class; the command line turns each class into exit 2 and one line.
    import argparse
    import importlib

    from tfllm.cli import main
    from tfllm.contracts import BAD_INPUT_EXIT_CODE
    error = getattr(importlib.import_module(module), name)("a.jsonl:3: bad\nsecond line")
    args = argparse.Namespace(command="train", workdir=None, out=None)
    code, line = main._failure(error, args)
    assert code == BAD_INPUT_EXIT_CODE and "\n" not in line and "a.jsonl:3: bad" in line
