"""What a user or a downloaded folder supplies is read through one guard (tfllm.confined):
regular files, bounded sizes, and what an export copies out of a run only the run's own
(issue 48 item 1). A scan of tfllm's source fails on a raw read anywhere else that is not
listed with its reason (pure AST, no TensorFlow), as tests/test_files.py does for writes."""

import ast
import os
import pathlib

import pytest

import tfllm
from tests.harness import dotted_name
from tfllm import files
from tfllm.config import Config
from tfllm.confined import tree_within
from tfllm.data.chat_template import (export_template, load_chat_template,
                                      store_chat_template)
from tfllm.data.errors import DataError
from tfllm.files import Refused

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture
def secret(tmp_path):
    """A user's file outside any run, that a crafted run or config names."""
    path = tmp_path / "home" / ".ssh" / "id_rsa"
    path.parent.mkdir(parents=True)
    path.write_text("-----BEGIN PRIVATE KEY-----")
    return path


def _data(chat_template=""):
    data = Config().data
    data.tokenizer, data.chat_template = "byte", chat_template
    return data


# ---- a template named by path: read as the run starts, stored in the run ---------------------
def test_the_run_keeps_its_template_and_the_export_copies_that_copy(tmp_path, secret):
    user = tmp_path / "chat.jinja"
    user.write_text(TEMPLATE)
    run = tmp_path / "run"
    assert store_chat_template(_data(str(user)), str(run)) == str(run / "chat_template.jinja")
    user.write_text("changed after the run started")
    # a config.yaml edited afterwards (or a downloaded run's) names the user's key
    tampered = _data(str(secret))
    out = tmp_path / "export"
    out.mkdir()
    export_template(tampered, str(out), run=str(run))
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert load_chat_template(tampered, str(run)).source == TEMPLATE


def test_a_run_without_its_copy_exports_no_file_the_config_names(tmp_path, secret):
    out = tmp_path / "export"
    out.mkdir()
    with pytest.raises(DataError, match=r"holds no copy of it .* copy the template the run "
                                        r"trained with to"):
        export_template(_data(str(secret)), str(out), run=str(tmp_path / "run"))
    assert os.listdir(out) == []


def test_a_link_at_the_run_s_copy_is_refused(tmp_path, secret):
    (tmp_path / "run").mkdir()
    os.symlink(secret, tmp_path / "run" / "chat_template.jinja")
    with pytest.raises(DataError, match="is a symbolic link"):
        load_chat_template(_data("chat.jinja"), str(tmp_path / "run"))


@pytest.mark.parametrize("make,fragment", [
    (lambda tmp: "/dev/zero", "is a character device, not a regular file"),
    (lambda tmp: (os.mkfifo(tmp / "fifo"), str(tmp / "fifo"))[1], "is a FIFO"),
    (lambda tmp: ((tmp / "big.jinja").write_text("x" * (2 << 20)), str(tmp / "big.jinja"))[1],
     "more than a chat template holds"),
    (lambda tmp: ((tmp / "latin1.jinja").write_bytes(b"caf\xe9"), str(tmp / "latin1.jinja"))[1],
     "not UTF-8 text"),
    (lambda tmp: str(tmp / "missing.jinja"), "cannot read it"),
])
def test_a_template_file_that_is_no_small_text_file_is_one_line(tmp_path, make, fragment):
    path = make(tmp_path)  # a FIFO or /dev/zero hung or exhausted memory before
    with pytest.raises(DataError, match=fragment) as e:
        store_chat_template(_data(path), str(tmp_path / "run"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


# ---- copies into an export never follow a link out of the run --------------------------------
def test_an_export_copy_of_the_run_s_tokenizer_refuses_a_link_out_of_the_run(
        tmp_path, secret):
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer.model").write_text("model")
    os.symlink(secret, run / "tokenizer" / "vocab.json")
    with pytest.raises(Refused, match=r"vocab.json leads to .*id_rsa, outside"):
        files.copy_tree(str(tmp_path / "out"), str(run / "tokenizer"), "tokenizer",
                        within=str(run))
    assert not any("id_rsa" in str(p) or p.is_file() and "PRIVATE" in p.read_text()
                   for p in (tmp_path / "out").rglob("*"))
    # a link inside the run is the run's own
    os.remove(run / "tokenizer" / "vocab.json")
    os.symlink(run / "tokenizer" / "tokenizer.model", run / "tokenizer" / "vocab.json")
    files.copy_tree(str(tmp_path / "out2"), str(run / "tokenizer"), "tokenizer",
                    within=str(run))
    assert (tmp_path / "out2" / "tokenizer" / "vocab.json").read_text() == "model"


def test_a_tokenizer_folder_that_is_a_link_out_of_the_run_is_refused(tmp_path, secret):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(secret.parent, run / "tokenizer")
    with pytest.raises(ValueError, match="outside"):
        tree_within(str(run / "tokenizer"), str(run), "an export copies")


def test_an_exported_run_s_keras_hub_tokenizer_is_checked_for_links(tmp_path, secret):
    from tfllm.pretrained.exporter import run_tokenizer_folder
    from tfllm.families import PretrainedError
    config = Config()
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    os.symlink(secret, run / "tokenizer" / "tokenizer.json")
    config.data.tokenizer, config.data.tokenizer_path = "file", str(run / "tokenizer")
    with pytest.raises(PretrainedError, match="outside"):
        run_tokenizer_folder(config, str(run))
    # a folder the user named themselves, outside the run, is theirs to link as they like
    config.data.tokenizer_path = str(secret.parent)
    assert run_tokenizer_folder(config, str(run)) == str(secret.parent)


# ---- the scan: nothing else in tfllm reads what a user supplies --------------------------------
ROOT = pathlib.Path(tfllm.__file__).parent

#: calls that read a file by path
_READS = {"open", "io.open", "json.load", "np.load", "numpy.load", "shutil.copy",
          "shutil.copy2", "shutil.copyfile", "shutil.copytree", "os.open"}
_READ_METHODS = {"read_text", "read_bytes"}

#: (file, what) -> why this raw read is not of what a user or a downloaded folder supplies,
#: or is bounded another way. A new read of user input goes through tfllm.confined
#: (read_regular / open_regular / inside / within), not into this table.
_ALLOWED = {
    ("confined.py", "os.open"): "the guard itself",
    ("runtime/watchdog.py", "open"): "a peer's heartbeat: a few bytes tfllm's own clients "
                                     "write in WORKDIR/logs",
    ("plan/gpu_compile.py", "open"): "a developer tool's own HLO and target files, written "
                                     "by tfllm plan in the same job",
    ("plan/planner.py", "open"): "/proc/meminfo, and the JSON and HLO the planner's own "
                                 "subprocess wrote into a temporary folder",
    ("plan/measured.py", "open"): "a benchmark job's result files that this process's "
                                  "child wrote",
    ("plan/measured.py", "json.load"): "the same result files",
    ("plan/planner.py", "json.load"): "the same",
    ("train/profile.py", "open"): "TensorFlow's own trace file, written in this run",
    ("data/feed.py", "open"): "the data iterator's state, in a temporary folder tfllm made",
    ("data/corpus.py", "open"): "tfllm's own source tree, the embedded corpus's text",
    ("data/pipeline.py", "open"): "the iterator state tf.train.Checkpoint wrote in a "
                                  "temporary folder tfllm made",
    ("data/pipeline.py", "json.load"): "the same",
    ("checkpoint/lock.py", "os.open"): "the checkpoint folder, opened only to hold its "
                                       "flock (nothing is read)",
    ("checkpoint/storage.py", "os.open"): "a checkpoint file opened read-only; its size "
                                          "and sha256 are checked against the manifest",
    ("checkpoint/storage.py", "open"): "done tokens and COMMIT records of a checkpoint, "
                                       "parsed strictly (checkpoint/storage.py)",
    ("checkpoint/storage.py", "json.load"): "the same",
    ("checkpoint/checkpointer.py", "open"): "a client's own files of the step, from a "
                                            "folder the caller names",
    ("checkpoint/reader.py", "open"): "a checkpoint's blocks, each checked against its "
                                      "sha256 and the index's sizes",
    ("compiler/hlo_dump.py", "open"): "XLA's dump, in a temporary folder tfllm made",
    ("compiler/fp8_hlo.py", "open"): "an HLO dump tfllm wrote",
    ("launch/main.py", "open"): "the launcher's own pid file",
    ("launch/scheduler.py", "open"): "a worker's exit record in the launcher's log folder",
}


def _reads(tree):
    """(line, what) of every raw read call in a module's syntax tree."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted_name(node.func)
        if name in _READS:
            yield node.lineno, name
        elif isinstance(node.func, ast.Attribute) and node.func.attr in _READ_METHODS:
            yield node.lineno, f".{node.func.attr}()"


def test_nothing_outside_the_guard_reads_what_a_user_supplies():
    """Every raw read of tfllm is the guard's (tfllm.confined), or names why it needs no
    guard in _ALLOWED; writes have their own scan (tests/test_files.py)."""
    found, used = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "files.py":  # writes (and its descriptor walks): the write scan's
            continue
        for line, what in _reads(ast.parse(path.read_text())):
            if (rel, what) in _ALLOWED:
                used.add((rel, what))
            else:
                found.append(f"tfllm/{rel}:{line}: {what}")
    assert not found, ("read what a user or a downloaded folder supplies through "
                       "tfllm.confined (read_regular, open_regular, inside, within), or "
                       "list the read in _ALLOWED with why:\n" + "\n".join(found))
    assert set(_ALLOWED) - used == set(), "remove the allow-list entries that match nothing"


def test_the_read_scan_sees_each_kind_of_read():
    source = '''
open(p); open(p, "rb"); json.load(f); np.load(p); shutil.copy(a, b); os.open(p, os.O_RDONLY)
pathlib.Path(p).read_text(); p.read_bytes(); json.loads(s)
'''
    assert [what for _, what in _reads(ast.parse(source))] == [
        "open", "open", "json.load", "np.load", "shutil.copy", "os.open", ".read_text()",
        ".read_bytes()"]


# ---- the run's own small records, as a copied or crafted run may hold them ------------------
@pytest.mark.parametrize("content", ["[1]", "[" * 100000, None])
def test_a_crafted_pretrained_json_is_one_line_or_none(tmp_path, content):
    from tfllm.families import PretrainedError
    from tfllm.pretrained.importer import read_origin
    if content is None:
        os.mkfifo(tmp_path / "pretrained.json")  # read, it would hang
        with pytest.raises(PretrainedError, match="is a FIFO"):
            read_origin(str(tmp_path))
        return
    (tmp_path / "pretrained.json").write_text(content)
    if content == "[1]":
        assert read_origin(str(tmp_path)) is None
    else:
        with pytest.raises(PretrainedError, match="pretrained.json: not JSON"):
            read_origin(str(tmp_path))


def test_a_marker_or_holder_record_that_is_a_fifo_is_no_record(tmp_path):
    from tfllm.checkpoint.lock import RunLock
    from tfllm.checkpoint.workdir import read_marker
    os.mkfifo(tmp_path / ".tfllm-run")
    assert read_marker(str(tmp_path)) is None  # not a hang
    (tmp_path / ".tfllm-locks").mkdir()
    os.mkfifo(tmp_path / ".tfllm-locks" / "client_0.holder")
    with RunLock(str(tmp_path), 0) as lock:  # read as no record (not a hang), then replaced
        assert lock.previous is None
        assert (tmp_path / ".tfllm-locks" / "client_0.holder").is_file()


@pytest.mark.parametrize("manifest", ["[1]", "[" * 100000, '{"format": 0}',
                                      '{"format": %d, "splits": {"train": {"file": '
                                      '"../../outside", "file_bytes": 1, "sha256": "x"}}}'])
def test_a_crafted_corpus_cache_is_no_cache(tmp_path, manifest):
    # data.data_dir is shared (~/.cache/tfllm): its manifest was a traceback when a list,
    # and its file names were joined without a check
    from tfllm.data import corpus
    if "%d" in manifest:
        manifest = manifest % corpus.FORMAT_VERSION
    (tmp_path / corpus.MANIFEST).write_text(manifest)
    assert corpus._valid(str(tmp_path)) is None  # rebuilt, never read through


def test_a_resume_with_another_template_than_the_run_s_is_one_line(tmp_path):
    from tfllm.data.chat_template import check_stored_template
    user = tmp_path / "chat.jinja"
    user.write_text(TEMPLATE)
    store_chat_template(_data(str(user)), str(tmp_path / "run"))
    check_stored_template(_data(str(user)), str(tmp_path / "run"))  # the same: fine
    user.write_text(TEMPLATE + "!")
    with pytest.raises(DataError, match=r"differs from the template this run trained with"):
        check_stored_template(_data(str(user)), str(tmp_path / "run"))
    check_stored_template(_data(str(user)), str(tmp_path / "older-run"))  # no copy: none
