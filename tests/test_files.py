"""tfllm.files, the one way tfllm writes and deletes: its behaviour (links planted in a
root are never followed, only what tfllm wrote is deleted), and a scan of tfllm's source
that fails on a write or delete anywhere else (pure AST, no TensorFlow)."""

import ast
import os
import pathlib

import pytest

import tfllm
from tests.harness import dotted_name
from tfllm import files
from tfllm.files import Refused


@pytest.fixture
def planted(tmp_path):
    """A root, and outside it a victim file and folder that links inside will name."""
    root, outside = tmp_path / "run", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_text("mine")
    return root, outside


def _untouched(outside):
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    assert (outside / "victim.txt").read_text() == "mine"


# ---- writes --------------------------------------------------------------------------------
def test_writes_land_inside_the_root_and_make_the_folders_between(tmp_path):
    root = tmp_path / "new" / "run"
    with files.open_for_writing(str(root), "logs/a.txt") as f:
        f.write("x")
    files.write_atomically(str(root), str(root / "b" / "c.json"), b"{}")
    with files.open_for_writing(str(root), "logs/a.txt", "a", append=True) as f:
        f.write("y")
    assert (root / "logs" / "a.txt").read_text() == "xy"
    assert (root / "b" / "c.json").read_bytes() == b"{}"
    assert sorted(os.listdir(root / "b")) == ["c.json"]  # no temporary left
    assert files.make_dirs(str(root), "d/e") == str(root / "d" / "e")


@pytest.mark.parametrize("root_given", ["relative", "absolute"])
def test_a_path_joined_from_a_relative_root_lands_in_it_not_one_level_down(
        tmp_path, monkeypatch, root_given):
    # `tfllm train` with its default --workdir runs/default (relative, as most are typed)
    # wrote config.yaml, metrics.jsonl, costs.json, loss.png, tensorboard/ and tokenizer/
    # into runs/default/runs/default/: each path was the workdir joined with a name, and
    # was joined to the root once more.
    monkeypatch.chdir(tmp_path)
    root = "runs/default" if root_given == "relative" else str(tmp_path / "runs/default")
    files.write_atomically(root, os.path.join("runs/default", "costs.json"), "{}")
    files.write_atomically(root, "config.yaml", "a: 1")  # a name below the root
    with files.open_for_writing(root, "runs/default/logs/client.0.log") as f:
        f.write("x")
    assert files.make_dirs(root, "runs/default/tensorboard") == str(
        tmp_path / "runs/default/tensorboard")
    files.replace(root, "runs/default/config.yaml", "runs/default/old.yaml")
    assert sorted(os.listdir(tmp_path / "runs/default")) == [
        "costs.json", "logs", "old.yaml", "tensorboard"]
    files.remove(root, "runs/default/costs.json")  # a name tfllm gives its own file
    assert not (tmp_path / "runs/default/costs.json").exists()
    # the rule reads only paths that begin with the root: a name is still below it
    files.write_atomically(root, "runs/x.json", "{}")
    assert (tmp_path / "runs/default/runs/x.json").exists()
    with pytest.raises(Refused, match="outside"):
        files.write_atomically(root, "runs/default/../../../elsewhere.json", "x")


def test_a_root_beside_the_current_directory_is_read_the_same_way(tmp_path, monkeypatch):
    # --workdir ../other/run from a sibling folder: its joined paths begin with `..`
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    files.write_atomically("../other/run", "../other/run/costs.json", "{}")
    files.write_atomically("../other/run", "config.yaml", "a: 1")
    assert sorted(os.listdir(tmp_path / "other/run")) == ["config.yaml", "costs.json"]
    with pytest.raises(Refused, match="outside"):
        files.write_atomically("../other/run", "../other/elsewhere.json", "x")


def test_a_relative_workdir_holds_the_run_s_outputs(tmp_path, monkeypatch):
    # ...and its marker went there too, so running the same command again (to resume)
    # found a workdir without one.
    from tfllm.checkpoint.workdir import Workdir, read_marker, write_marker
    monkeypatch.chdir(tmp_path)
    write_marker("runs/default", "train")
    Workdir("runs/default").write_costs({"steps": 1})
    assert sorted(os.listdir(tmp_path / "runs/default")) == [".tfllm-run", "costs.json"]
    assert read_marker("runs/default")["kind"] == "train"


@pytest.mark.parametrize("write", [
    lambda root: files.open_for_writing(root, "out.txt").close(),
    lambda root: files.open_for_writing(root, "out.txt", "a", append=True).close(),
    lambda root: files.write_atomically(root, "out.txt", "x"),
    lambda root: files.write_atomically(root, "new.txt", "x", suffix=".txt"),  # temp = link
])
def test_a_link_planted_at_a_file_name_is_refused(planted, write):
    root, outside = planted
    os.symlink(outside / "victim.txt", root / "out.txt")
    os.symlink(outside / "victim.txt", root / "new.txt.txt")
    with pytest.raises(Refused, match="is a symbolic link .*where tfllm writes"):
        write(str(root))
    _untouched(outside)


@pytest.mark.parametrize("write", [
    lambda root: files.open_for_writing(root, "logs/rank_0.log"),
    lambda root: files.write_atomically(root, "logs/sub/x", "x"),
    lambda root: files.make_dirs(root, "logs/sub"),
    lambda root: files.replace(root, "a.txt", "logs/a.txt"),
    lambda root: files.copy_file(root, __file__, "logs/copy.py"),
])
def test_a_link_planted_at_a_folder_is_never_walked_through(planted, write):
    root, outside = planted
    (root / "a.txt").write_text("a")
    os.symlink(outside, root / "logs")
    with pytest.raises(Refused, match=f"{root / 'logs'} is a symbolic link"):
        write(str(root))
    _untouched(outside)


def test_the_root_itself_may_be_a_link_the_user_made(tmp_path):
    disk = tmp_path / "scratch"
    disk.mkdir()
    os.symlink(disk, tmp_path / "run")
    files.write_atomically(str(tmp_path / "run"), "checkpoints/x.json", "{}")
    assert (disk / "checkpoints" / "x.json").read_text() == "{}"


def test_a_fifo_planted_at_a_file_name_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(Refused, match="no regular file"):
        files.open_for_writing(str(tmp_path), "metrics.jsonl", "a", append=True)


def test_paths_outside_the_root_are_refused(planted):
    root, outside = planted
    for path in (outside / "victim.txt", "../outside/victim.txt"):
        with pytest.raises(Refused, match="outside"):
            files.write_atomically(str(root), path, "x")
        with pytest.raises(Refused, match="outside"):
            files.remove(str(root), path)
    _untouched(outside)


def test_replace_renames_inside_the_root_and_refuses_a_link_at_either_end(planted):
    root, outside = planted
    (root / "step_00000001.tmp-ab").mkdir()
    files.replace(str(root), "step_00000001.tmp-ab", "step_00000001")
    assert (root / "step_00000001").is_dir()
    os.symlink(outside, root / "step_00000002")
    (root / "x").mkdir()
    with pytest.raises(Refused, match="symbolic link"):
        files.replace(str(root), "x", "step_00000002")
    with pytest.raises(Refused, match="symbolic link"):
        files.replace(str(root), "step_00000002", "y")
    _untouched(outside)


# ---- deletes -------------------------------------------------------------------------------
def test_deleting_what_tfllm_wrote_is_fine(tmp_path):
    root = str(tmp_path)
    files.write_atomically(root, "metrics.jsonl", "{}\n")
    files.write_atomically(root, "checkpoints/step_00000003/COMMIT", "{}")
    files.write_atomically(root, "checkpoints/step_00000004.tmp-0a1b/files/x", "x")
    assert files.remove(root, "metrics.jsonl") is True
    assert files.remove(root, "checkpoints/step_00000003/COMMIT") is True
    assert files.remove_tree(root, "checkpoints/step_00000003") is True
    assert files.remove_tree(root, "checkpoints/step_00000004.tmp-0a1b") is True
    assert files.remove(root, "metrics.jsonl") is False  # gone: nothing to do
    made = files.make_dirs(root, "any-name/inside")  # made by this process: its own
    assert files.remove_tree(root, made) is True
    assert sorted(os.listdir(tmp_path)) == ["any-name", "checkpoints"]


@pytest.mark.parametrize("name", ["notes.txt", "metrics.jsonl.bak", "step_1", "data"])
def test_deleting_a_user_s_file_or_folder_is_refused(tmp_path, name):
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / name).write_text("mine")
    (tmp_path / "folder" / name).mkdir(parents=True)
    with pytest.raises(Refused, match="was not written by tfllm"):
        files.remove(str(tmp_path), f"file/{name}")
    with pytest.raises(Refused, match="was not written by tfllm"):
        files.remove_tree(str(tmp_path), f"folder/{name}")
    assert (tmp_path / "file" / name).read_text() == "mine"
    assert (tmp_path / "folder" / name).is_dir()


def test_a_link_named_like_tfllm_s_own_is_never_deleted_nor_followed(planted):
    root, outside = planted
    os.symlink(outside, root / "step_00000001")
    os.symlink(outside / "victim.txt", root / "COMMIT")
    with pytest.raises(Refused, match="deletes none"):
        files.remove_tree(str(root), "step_00000001")
    with pytest.raises(Refused, match="deletes none"):
        files.remove(str(root), "COMMIT")
    os.symlink(outside, root / "tensorboard")  # a folder on the way is a link: refused
    with pytest.raises(Refused, match="is a symbolic link"):
        files.remove(str(root), "tensorboard/COMMIT")
    _untouched(outside)
    assert os.path.islink(root / "step_00000001") and os.path.islink(root / "COMMIT")


def test_a_tree_tfllm_owns_is_removed_without_following_links_inside(planted):
    root, outside = planted
    (root / "tensorboard" / "sub").mkdir(parents=True)
    os.symlink(outside, root / "tensorboard" / "sub" / "escape")
    os.symlink(outside / "victim.txt", root / "tensorboard" / "victim")
    assert files.remove_tree(str(root), "tensorboard") is True
    assert not (root / "tensorboard").exists()
    _untouched(outside)


def test_temporary_folders_are_removed_and_only_they(tmp_path):
    with files.temporary_folder("tfllm-test-", str(tmp_path)) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path)
        files.write_atomically(tmp, "a/b.bin", b"x")
    assert not os.path.exists(tmp)
    other = tmp_path / "tfllm-not-made-here"
    other.mkdir()
    with pytest.raises(Refused, match="was not written by tfllm"):
        files.remove_tree(str(other))


def test_remove_empty_folder_undoes_only_folders_this_process_made(tmp_path):
    made = files.make_dirs(str(tmp_path / "a" / "b"))
    (tmp_path / "mine").mkdir()
    assert files.remove_empty_folder(str(tmp_path / "mine")) is False
    assert files.remove_empty_folder(made) is True
    assert files.remove_empty_folder(str(tmp_path / "a")) is True  # an ancestor made too
    assert sorted(os.listdir(tmp_path)) == ["mine"]


def test_an_export_folder_is_new_and_only_its_own_temporary_is_removed(tmp_path):
    out = tmp_path / "export"
    out.mkdir()  # an empty --out is fine: the rename replaces it
    with files.written_atomically(files.require_new_folder(str(out))) as tmp:
        files.write_atomically(tmp, "config.json", "{}")
    assert os.listdir(out) == ["config.json"]
    with pytest.raises(ValueError, match="exists and is not empty"):
        files.require_new_folder(str(out))
    with pytest.raises(RuntimeError):
        with files.written_atomically(str(tmp_path / "failed")) as tmp:
            raise RuntimeError("export failed")
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_every_name_tfllm_deletes_is_in_the_table():
    for name in ("step_00000012", "step_00000012.tmp-0f0f0f0f", "step_00000012.replaced-1a",
                 "COMMIT", "metrics.jsonl", "metrics.jsonl.tmp", "config.yaml.tmp",
                 "loss.png.tmp.png", "costs.json.part", "tensorboard", "tokenizer",
                 "client_3.holder", ".tfllm-writer", "ready.0", "run.importing",
                 ".out.exporting-host-a-12-ab_c3"):
        assert files.owned_name(name), name
    for name in ("step_12", "checkpoints", ".tfllm-run", "logs", "notes.tmp", "x.part",
                 "client_3.lock", "COMMIT.bak", ".out.exporting-ab_c3"):
        assert not files.owned_name(name), name


# ---- the scan: nothing else in tfllm writes or deletes ----------------------------------------
ROOT = pathlib.Path(tfllm.__file__).parent

#: module.function calls that write, rename or delete by path
_BY_PATH = {
    "os": {"remove", "unlink", "rmdir", "removedirs", "replace", "rename", "renames",
           "makedirs", "mkdir", "mkfifo", "symlink", "link", "truncate"},
    "shutil": {"rmtree", "move", "copy", "copy2", "copyfile", "copytree"},
    "tempfile": {"mkdtemp", "mkstemp", "NamedTemporaryFile", "TemporaryDirectory"},
}
#: methods that write or delete whatever their object is (pathlib.Path's; `replace` is
#: left out: str.replace is everywhere)
_PATH_METHODS = {"write_text", "write_bytes", "unlink", "mkdir", "rmdir", "touch",
                 "symlink_to", "hardlink_to", "rename"}
#: libraries' writers that take a path, allowed only where _ALLOWED names them
_LIBRARY_WRITERS = {"create_file_writer", "TFRecordWriter", "Checkpoint", "save_weights",
                    "export", "save_to_preset", "export_tokenizer", "GFile"}
_NUMPY_WRITERS = {f"{np}.{f}" for np in ("np", "numpy")
                  for f in ("save", "savez", "savez_compressed", "savetxt")}
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}
#: XLA flags that make XLA write into a folder
_XLA_FOLDER_FLAGS = ("--xla_dump_to", "--tf_xla_persistent_cache_directory",
                     "--xla_gpu_per_fusion_autotune_cache_dir")

#: (file, what) -> why it may write without tfllm.files: libraries that write by path,
#: each into a folder tfllm.files made (see its docstring)
_ALLOWED = {
    ("data/pipeline.py", "Checkpoint"):
        "tf.train.Checkpoint writes a data iterator's state under a prefix inside a "
        "temporary folder made by tfllm.files (tfllm.data.feed), read back as bytes",
    ("data/corpus.py", "TFRecordWriter"):
        "TensorFlow writes the corpus cache's TFRecord files into a temporary folder made "
        "by tfllm.files, then renamed into the cache by tfllm.files.replace",
    ("train/tensorboard.py", "create_file_writer"):
        "TensorFlow's event files, in WORKDIR/tensorboard made by tfllm.files.make_dirs",
    ("train/profile.py", "start"):
        "TensorFlow's profiler traces, in WORKDIR/tensorboard[/client_N] made by "
        "tfllm.files.make_dirs",
    ("train/export.py", "save_weights"):
        "Keras writes the weights into the new folder of tfllm.files.written_atomically",
    ("train/export.py", "export"):
        "Keras' SavedModel, into the new folder of tfllm.files.written_atomically",
    ("pretrained/exporter.py", "save_to_preset"):
        "keras-hub's preset, into the new folder of tfllm.files.written_atomically",
    ("pretrained/importer.py", "save_to_preset"):
        "keras-hub writes the tokenizer into the import's folder, made by tfllm.files in "
        "this process (WORKDIR.importing, renamed into place last)",
    ("pretrained/demo.py", "save_to_preset"):
        "a developer's script that writes a demo preset where --out says (not a command "
        "of tfllm)",
    ("internals.py", "export_tokenizer"):
        "keras-hub's Hugging Face tokenizer writer, into the new folder of "
        "tfllm.files.written_atomically (tfllm export --format hf)",
    ("runtime/environment.py", "xla flag"):
        "XLA's compile cache and autotune folders, made by tfllm.files.make_dirs",
    ("compiler/hlo_dump.py", "xla flag"):
        "XLA dumps into a temporary folder made by tfllm.files (or the user's own "
        "--xla_dump_to, which tfllm never deletes)",
    ("plan/measured.py", "xla flag"):
        "a benchmark's dump folder, named by its caller (tfllm plan passes none)",
}


def _write_mode(call: ast.Call):
    """open()'s mode when it writes (or cannot be known), else None."""
    mode = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None:
        return None
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return mode.value if set(mode.value) & set("wax+") else None
    return "(a computed mode)"


def _strings(tree):
    """The string constants of a module that are not docstrings."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings):
            yield node


def _writes(tree):
    """(line, what) of every write or delete call in a module's syntax tree."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted_name(node.func)
        module, _, function = name.rpartition(".")
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else name
        if name == "open" and _write_mode(node):
            yield node.lineno, f"open(..., {_write_mode(node)!r})"
        elif function in _BY_PATH.get(module.split(".")[-1] if module else "", ()):
            yield node.lineno, name
        elif name in {"os.open"} and _WRITE_FLAGS & {
                n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}:
            yield node.lineno, "os.open(write flags)"
        elif isinstance(node.func, ast.Attribute) and attr in _PATH_METHODS:
            yield node.lineno, f".{attr}()"
        elif "gfile" in name.split("."):
            yield node.lineno, name
        elif attr in _LIBRARY_WRITERS or name.endswith("profiler.experimental.start"):
            yield node.lineno, attr
        elif (name in _NUMPY_WRITERS or attr in {"savefig", "tofile"}) and node.args \
                and not isinstance(node.args[0], ast.Name):
            # numpy and matplotlib write by path unless given a file object (a name)
            yield node.lineno, f"{attr}(a path)"
    for node in _strings(tree):
        if any(flag in node.value for flag in _XLA_FOLDER_FLAGS):
            yield node.lineno, "xla flag"


def test_nothing_outside_tfllm_files_writes_or_deletes():
    """Every write, rename and delete of tfllm goes through tfllm.files (see its
    docstring); a library that writes by path is named in _ALLOWED with why."""
    found, used = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "files.py":
            continue
        for line, what in _writes(ast.parse(path.read_text())):
            if (rel, what) in _ALLOWED:
                used.add((rel, what))
            else:
                found.append(f"tfllm/{rel}:{line}: {what}")
    assert not found, ("write or delete through tfllm.files (open_for_writing, "
                       "write_atomically, replace, remove, remove_tree, make_dirs, "
                       "temporary_folder):\n" + "\n".join(found))
    assert set(_ALLOWED) - used == set(), "remove the allow-list entries that match nothing"


def test_the_scan_sees_each_kind_of_write():
    source = '''
open(p, "w"); open(p, mode="ab"); open(p, m); open(p); open(p, "rb")
os.remove(p); os.replace(a, b); shutil.rmtree(p); tempfile.mkdtemp(); os.makedirs(p)
pathlib.Path(p).write_text("x"); p.unlink(); tf.io.gfile.makedirs(p)
os.open(p, os.O_WRONLY | os.O_CREAT); os.open(p, os.O_RDONLY)
np.savez(os.path.join(d, "x.npz")); np.savez(f); fig.savefig(buffer)
env["XLA_FLAGS"] = f"--xla_dump_to={d}"
"x".replace("a", "b")
'''
    assert [what for _, what in _writes(ast.parse(source))] == [
        "open(..., 'w')", "open(..., 'ab')", "open(..., '(a computed mode)')", "os.remove",
        "os.replace", "shutil.rmtree", "tempfile.mkdtemp", "os.makedirs", ".write_text()",
        ".unlink()", "tf.io.gfile.makedirs", "os.open(write flags)", "savez(a path)",
        "xla flag"]
