"""The one way tfllm writes and deletes files: inside a root it owns, never through a
symbolic link, deleting only what it wrote.

Every file and folder tfllm creates, writes, renames or deletes goes through this module
(tests/test_files.py fails on such a call anywhere else). Each call names a *root*, the
folder tfllm owns for that write: a run's workdir (or its checkpoints/, logs/ or XLA cache
folder, which may be links to another disk: the user made them), an export's new folder,
the data cache (data.data_dir), a launcher's log folder, or a temporary folder made here.
The root's own path is the user's and is taken as given (a --workdir that is a link to a
scratch disk is fine); below the root nothing is followed:

* **Paths are walked, not resolved.** Each folder below the root is opened with
  O_NOFOLLOW relative to its parent's descriptor (openat), and the file or folder at the
  end is created, renamed or removed relative to its parent's descriptor. A symbolic link
  at any component is refused (`Refused`: one line naming it, exit 2), so a link planted in
  a run (to a user's file, another run's checkpoint, /) is never written or deleted through;
  no name is checked and then used, so a link swapped in between cannot redirect a write.
  Files are opened non-blocking and must be regular: a FIFO planted at a name is refused.
* **Only what tfllm wrote is deleted.** `remove`, `remove_tree` and `remove_empty_folder`
  delete a path only when it is no link and either this process made it here
  (`make_dirs`, `new_temporary_folder`: remembered for the life of the process) or its name
  is one tfllm gives its own files (`OWNED_NAMES`: checkpoints, a run's outputs and the
  temporary names of their atomic writes, lock records, readiness files, a crashed import);
  anything else is refused with one line. A folder is removed by `shutil.rmtree` on its
  parent's descriptor, which unlinks the links inside it without following them.
* **Output folders are new.** `require_new_folder` refuses an existing non-empty --out, the
  filesystem root, and the run or a folder holding it; `written_atomically` writes into a
  temporary folder it makes beside --out and renames it last, deleting only that folder.

The calls: `make_dirs`, `open_for_writing`, `write_atomically`, `replace`, `copy_file`,
`copy_tree`, `new_temporary_folder` / `temporary_folder`, `remove`, `remove_tree`,
`remove_empty_folder`, and for exports `require_new_folder` and `written_atomically`.

The threat is a file planted in a folder tfllm owns (a shared or copied workdir, a crafted
checkpoint folder, a mistaken link) before or between tfllm's writes. Another user who may
write into the root while tfllm writes there is not: the root's permissions are the user's.

Libraries that write by path (TensorFlow's tf.train.Checkpoint, SavedModel, summaries,
profiler traces and TFRecord files; Keras' save_weights and save_to_preset; XLA's dump and
compile-cache folders named in its flags) cannot write through a descriptor. They are
given a folder made here: a fresh temporary folder (mode 0700, renamed into place by
`replace`), or a run folder `make_dirs` walked and made (no link), and tests/test_files.py
names each such call and why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
from typing import Optional, Union

from tfllm.confined import open_regular, tree_within
from tfllm.contracts import InputError, RUN_OUTPUTS, WRITER_RECORD
from tfllm.runpaths import CLIENT, HOLDER_SUFFIX


class Refused(InputError):
    """A write or delete tfllm does not make: through a symbolic link, outside its root, or
    of a file it did not write. One line naming the path and the fix (exit 2)."""


#: suffixes of the temporary names of tfllm's atomic writes (config.yaml.tmp,
#: costs.json.part, loss.png.tmp.png): a crash may leave one beside a run's output
TEMPORARY_SUFFIXES = (".tmp", ".part", ".tmp.png")

_OUTPUTS = "|".join(re.escape(name) for name in RUN_OUTPUTS)
_SUFFIXES = "|".join(re.escape(suffix) for suffix in TEMPORARY_SUFFIXES)
#: the names tfllm gives what it later deletes: `remove` and `remove_tree` refuse any other
#: path this process did not make
OWNED_NAMES = (
    (r"step_\d{8}", "a checkpoint (tfllm.checkpoint.storage)"),
    (r"step_\d{8}\.(tmp|replaced)-[0-9a-f]+", "an unfinished or replaced checkpoint"),
    (r"COMMIT", "a checkpoint's commit record (deleted first, with its checkpoint)"),
    (f"({_OUTPUTS})({_SUFFIXES})?", "a run's output or its temporary name "
                                    "(cleared with a dead run: tfllm.checkpoint.workdir)"),
    (re.escape(CLIENT).replace(r"\{\}", r"\d+") + re.escape(HOLDER_SUFFIX),
     "a run lock's holder record (tfllm.checkpoint.lock)"),
    (re.escape(WRITER_RECORD), "a checkpoint folder's writer record (tfllm.checkpoint.lock)"),
    (r"ready\.\d+", "a worker's readiness file (tfllm launch)"),
    (r".+\.importing", "a crashed tfllm import (deleted only with its marker)"),
    (r"\..+\.exporting-.+-\d+-[A-Za-z0-9_]+", "an export's temporary folder beside --out "
                                            "(deleted only when its process is gone)"),
)
_OWNED = re.compile("|".join(f"(?:{pattern})" for pattern, _ in OWNED_NAMES))

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_made: set = set()  # absolute paths of the folders this process made (see the module)
# temporary folders stay this process's after removal: a library given one may make it
# again (XLA's dump folder), and its random name is no one else's
_temporary: set = set()
_made_lock = threading.Lock()


def owned_name(name: str) -> bool:
    """Whether `name` (one path component) is one tfllm gives what it deletes."""
    return bool(_OWNED.fullmatch(name))


# ---- walking a path below its root ----------------------------------------------------------
def _split(root: str, path) -> tuple:
    """(the root as an absolute path, the components of `path` below it).

    `path` is None for the root itself, absolute, or relative. A relative path that
    begins with the root as seen from the current directory (`runs/default/costs.json`
    for the root `runs/default`, given as such or absolute) was made by joining the root
    and a name, and is read from the current directory; any other relative path is a name
    below the root (`config.json`). Without the first rule, a relative --workdir wrote its
    files one level down, into WORKDIR/runs/default/."""
    root = os.path.abspath(os.path.expanduser(root))
    if path is None:
        return root, []
    path = os.path.normpath(os.fspath(path))
    from_cwd = False
    if not os.path.isabs(path):
        try:  # `../runs/x` for a root beside the current directory; never `./`: normalized
            seen = os.path.relpath(root, os.getcwd())
        except FileNotFoundError:  # the current directory is gone: nothing is read from it
            seen = os.curdir
        from_cwd = path.startswith(seen + os.sep)
    full = os.path.abspath(path if from_cwd else os.path.join(root, path))
    rel = os.path.relpath(full, root)
    if rel == os.curdir:
        return root, []
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise Refused(f"{full} is outside {root}, the folder tfllm owns for this write; "
                      "tfllm writes and deletes only inside it.")
    return root, rel.split(os.sep)


def _absolute(root: str, path) -> str:
    root, parts = _split(root, path)
    return os.path.join(root, *parts)


def _refuse_link(dir_fd: int, name: str, full: str) -> None:
    """Raises `Refused` when `name` in `dir_fd` is a symbolic link."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        try:
            target = f" (to {os.readlink(name, dir_fd=dir_fd)})"
        except OSError:
            target = ""
        raise Refused(f"{full} is a symbolic link{target} where tfllm writes its own files "
                      "(it writes no links and never through one): remove the link, then "
                      "run the command again.")


def _remember(path: str) -> None:
    with _made_lock:
        _made.add(path)


def _open_root(root: str, create: bool) -> int:
    """A descriptor of the root (its own path may hold links: the user's), made when
    `create` (its missing ancestors too, remembered as made here)."""
    if create and not os.path.isdir(root):
        missing, path = [], root
        while not os.path.lexists(path) and os.path.dirname(path) != path:
            missing.append(path)
            path = os.path.dirname(path)
        os.makedirs(root, exist_ok=True)
        for path in missing:
            _remember(path)
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _walk(root: str, parts: list, create: bool) -> int:
    """A descriptor of root/parts..., each folder below the root opened without following
    a link (and made when missing and `create`). The caller closes it."""
    fd = _open_root(root, create)
    try:
        for i, name in enumerate(parts):
            full = os.path.join(root, *parts[:i + 1])
            if create:
                try:
                    os.mkdir(name, 0o777, dir_fd=fd)
                    _remember(full)
                except FileExistsError:
                    pass
            try:
                next_fd = os.open(name, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    _refuse_link(fd, name, full)
                raise OSError(e.errno, e.strerror, full) from None
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _parent(root: str, path, create: bool = False):
    """(descriptor of the folder holding `path`, its name there, its full path)."""
    root, parts = _split(root, path)
    if not parts:
        raise Refused(f"{root}: tfllm writes files inside this folder, not the folder "
                      "itself.")
    fd = _walk(root, parts[:-1], create)
    try:
        yield fd, parts[-1], os.path.join(root, *parts)
    finally:
        os.close(fd)


# ---- writing ------------------------------------------------------------------------------
def make_dirs(root: str, path=None) -> str:
    """Makes `path` (absolute or relative to `root`; None: the root itself) and the folders
    between, none of them a link; returns its absolute path.

    Args:
      root: the folder tfllm owns for this write (made when missing).
      path: a folder inside it.
    """
    root, parts = _split(root, path)
    os.close(_walk(root, parts, create=True))
    return _absolute(root, path)


def _open_file(dir_fd: int, name: str, full: str, flags: int) -> int:
    """`name` opened in `dir_fd` with `flags` (O_NOFOLLOW, non-blocking while opened) when
    it is or becomes a regular file; a link or anything else is refused."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            _refuse_link(dir_fd, name, full)
            if e.errno != errno.EISDIR:
                raise Refused(f"{full} is no regular file (a FIFO or a device) where tfllm "
                              "writes its own file: remove it, then run the command "
                              "again.") from None
        raise OSError(e.errno, e.strerror, full) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(f"{full} is no regular file where tfllm writes its own file: remove "
                      "it, then run the command again.")
    os.set_blocking(fd, True)
    return fd


def open_for_writing(root: str, path, mode: str = "w", append: bool = False, **kwargs):
    """`open(path, mode)` for one of tfllm's files inside `root`, made with the folders
    between when missing; nothing on the way, nor the file itself, may be a link.

    Args:
      root: the folder tfllm owns for this write.
      path: the file (absolute, or relative to `root`).
      mode: "w" or "wb" (truncates), or "a"/"ab" with `append`.
      append: open for appending (created when missing) instead of truncating.
      **kwargs: more arguments of `open` (e.g. buffering=0).
    """
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    with _parent(root, path, create=True) as (dir_fd, name, full):
        fd = _open_file(dir_fd, name, full, flags)
    try:
        return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}), **kwargs)
    except BaseException:
        os.close(fd)
        raise


def write_atomically(root: str, path, data: Union[bytes, str], suffix: str = ".tmp",
                     durable: bool = False) -> None:
    """Writes `data` to `path` whole or not at all: into `path` + `suffix`, then renamed.

    Args:
      root: the folder tfllm owns for this write.
      path: the file (absolute, or relative to `root`); a link there is refused.
      data: bytes, or text (UTF-8).
      suffix: the temporary name's suffix (one of `TEMPORARY_SUFFIXES` for a run's output,
        so that a crash's leftover is known; with the pid where processes share a name).
      durable: fsync the file and its folder (checkpoints).
    """
    data = data.encode("utf-8") if isinstance(data, str) else data
    with _parent(root, path, create=True) as (dir_fd, name, full):
        tmp = name + suffix
        fd = _open_file(dir_fd, tmp, full + suffix,
                        os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            _refuse_link(dir_fd, name, full)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException as e:
            with contextlib.suppress(OSError):  # its own temporary file, just made
                os.unlink(tmp, dir_fd=dir_fd)
            if isinstance(e, OSError) and e.filename is None:  # a write names no path
                raise OSError(e.errno, e.strerror, full) from None
            raise
        if durable:
            os.fsync(dir_fd)


def replace(root: str, src, dst) -> None:
    """Renames `src` to `dst` (both inside `root`; `dst` may be an empty folder when `src`
    is a folder, as rename(2) allows); neither may be a link.

    Args:
      root: the folder tfllm owns for this write.
    """
    with _parent(root, src) as (src_fd, src_name, src_full), \
            _parent(root, dst, create=True) as (dst_fd, dst_name, dst_full):
        _refuse_link(src_fd, src_name, src_full)
        _refuse_link(dst_fd, dst_name, dst_full)
        try:
            os.replace(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, src_full, None, dst_full) from None


def copy_file(root: str, src: str, dst) -> str:
    """Copies the regular file `src` (any path: the user's input) to `dst` inside `root`
    (`open_for_writing`); returns `dst`'s absolute path."""
    with open_regular(src, None, "a file to copy", Refused) as f_in, \
            open_for_writing(root, dst, "wb") as f_out:
        try:
            shutil.copyfileobj(f_in, f_out)
            f_out.flush()
        except OSError as e:
            if e.filename is not None:
                raise
            raise OSError(e.errno, e.strerror, _absolute(root, dst)) from None
    return _absolute(root, dst)


def copy_tree(root: str, src: str, dst, within: Optional[str] = None) -> str:
    """Copies the folder `src` (its files' contents; links in it are read through, each
    folder once) to `dst` inside `root`; returns `dst`'s absolute path.

    Args:
      within: a folder every file copied must resolve inside (a run's workdir, for an
        export: a link planted in the run out of it is refused, never copied); None: the
        user named `src` and links in it lead where the user made them.
    """
    target = make_dirs(root, dst)
    seen = set()
    if within is not None:
        tree_within(src, within, "an export copies", Refused)
    for folder, folders, names in os.walk(src, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            folders[:] = []
            continue
        seen.add(real)
        rel = os.path.relpath(folder, src)
        make_dirs(root, os.path.normpath(os.path.join(target, rel)))
        for name in names:
            copy_file(root, os.path.join(folder, name),
                      os.path.normpath(os.path.join(target, rel, name)))
    return target


# ---- temporary folders --------------------------------------------------------------------
def new_temporary_folder(prefix: str = "tfllm-", parent: Optional[str] = None) -> str:
    """A new folder (mode 0700, made here: `remove_tree` may delete it) in `parent`
    (made when missing; default: the system's temporary folder); returns its path."""
    if parent is not None:
        make_dirs(parent)
    path = os.path.abspath(tempfile.mkdtemp(prefix=prefix, dir=parent))
    with _made_lock:
        _temporary.add(path)
    return path


@contextlib.contextmanager
def temporary_folder(prefix: str = "tfllm-", parent: Optional[str] = None):
    """`new_temporary_folder`, removed with all it holds when the block ends."""
    path = new_temporary_folder(prefix, parent)
    try:
        yield path
    finally:
        remove_tree(path, ignore_errors=True)


# ---- deleting -----------------------------------------------------------------------------
def _made_here(path: str) -> bool:
    with _made_lock:
        return path in _made or path in _temporary


def _forget(path: str) -> None:
    with _made_lock:
        for made in [p for p in _made if p == path or p.startswith(path + os.sep)]:
            _made.discard(made)


def _check_owned(full: str, name: str, st) -> None:
    """Raises `Refused` unless tfllm may delete `full` (see the module)."""
    if stat.S_ISLNK(st.st_mode):
        raise Refused(f"{full} is a symbolic link; tfllm writes no links, so it deletes "
                      "none (nor what one points to): remove it yourself if it is not "
                      "needed.")
    if not (_made_here(full) or owned_name(name)):
        raise Refused(f"{full} was not written by tfllm (not made by this process, nor "
                      "named as tfllm names its files); tfllm deletes only what it wrote: "
                      "move it away yourself.")


def _deletable(root: str, path, want_dir: bool):
    """(parent's descriptor, name, full path) of `path` when it exists and tfllm may
    delete it (else `Refused`), or None when it is missing; the caller closes the
    descriptor. `path` None: the root itself (a folder made here)."""
    if path is None:
        root = os.path.abspath(os.path.expanduser(root))
        root, path = os.path.dirname(root), os.path.basename(root)
    root, parts = _split(root, path)
    if not parts:
        raise Refused(f"{root}: tfllm deletes only inside the folder it owns, not the "
                      "folder itself.")
    full, name = os.path.join(root, *parts), parts[-1]
    try:
        fd = _walk(root, parts[:-1], create=False)
    except FileNotFoundError:
        return None
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        _check_owned(full, name, st)
        if stat.S_ISDIR(st.st_mode) != want_dir:
            raise Refused(f"{full} is {'no' if want_dir else 'a'} folder where tfllm "
                          f"deletes {'a folder' if want_dir else 'a file'} of its own; it "
                          "is left as it is.")
    except FileNotFoundError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd, name, full


def remove(root: str, path) -> bool:
    """Deletes the file `path` inside `root` when tfllm wrote it (see the module; a link
    or anything else is refused); returns False when it was missing."""
    found = _deletable(root, path, want_dir=False)
    if found is None:
        return False
    fd, name, _ = found
    try:
        os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    return True


def remove_tree(root: str, path=None, ignore_errors: bool = False) -> bool:
    """Deletes the folder `path` inside `root` (None: `root` itself, a folder made here)
    with all it holds, when tfllm made it (see the module); links inside are unlinked,
    never followed. Returns False when it was missing.

    Args:
      ignore_errors: as shutil.rmtree's (a refusal is still raised).
    """
    found = _deletable(root, path, want_dir=True)
    if found is None:
        return False
    fd, name, full = found
    try:
        shutil.rmtree(name, ignore_errors=ignore_errors, dir_fd=fd)
    finally:
        os.close(fd)
    _forget(full)
    return True


def remove_empty_folder(path: str) -> bool:
    """Removes `path` when this process made it (`make_dirs`) and it is empty; True when
    removed. Never raises: for undoing folders made by a command that then failed."""
    path = os.path.abspath(path)
    if not _made_here(path):
        return False
    try:
        with _parent(os.path.dirname(path), path) as (fd, name, _):
            os.rmdir(name, dir_fd=fd)
    except (OSError, Refused):
        return False
    _forget(path)
    return True


def missing_folders(path: str) -> list:
    """`path` and its ancestors that do not exist yet, deepest first: what a command is
    about to create, to undo with `remove_empty_folders` if it then fails."""
    missing, path = [], os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_empty_folders(folders: list) -> None:
    """Removes `folders` (deepest first) up to the first that is not empty, is gone, or
    was not made by this process (`remove_empty_folder`). Never raises."""
    for path in folders:
        if not remove_empty_folder(path):
            return


# ---- new output folders (every `tfllm export` format) ---------------------------------------
def require_new_folder(out: str, error=ValueError, keep=()) -> str:
    """`out` as an absolute path for a new output folder: it must not exist or be an empty
    folder (an export never overwrites or deletes files; a link to an empty folder is that
    folder: the path returned is the folder it names), and it may not be the
    filesystem root, nor any folder in `keep` (the run's workdir) or one holding it.

    Args:
      out: the folder the user named (--out).
      error: the exception class to raise (one line, exit 2 at the command line).
      keep: folders the output may not replace or contain (e.g. the workdir).
    """
    out = os.path.abspath(os.path.expanduser(out))
    real = os.path.realpath(out)
    if os.path.islink(out) and os.path.isdir(real) and not os.listdir(real):
        out = real  # a link to an empty folder: the export goes into the folder it names
    if real == os.path.dirname(real):
        raise error(f"--out {out} is the filesystem root; export into a new directory.")
    for folder in keep:
        held = os.path.realpath(os.path.expanduser(folder))
        if real == held or held.startswith(real.rstrip(os.sep) + os.sep):
            raise error(f"--out {out} is or holds the run {folder}; export into a new "
                        "directory (an export never replaces a run).")
    if os.path.lexists(out) and (not os.path.isdir(out) or os.path.islink(out)
                                 or os.listdir(out)):
        raise error(f"--out {out} exists and is not empty; export into a new directory "
                    "(an export never overwrites files).")
    return out


#: an export's temporary folder beside --out: .NAME.exporting-HOST-PID-RANDOM
_EXPORTING = re.compile(r"\.(?P<name>.+)\.exporting-(?P<host>.+)-(?P<pid>\d+)-[A-Za-z0-9_]+")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's live process
        return False
    return False


def _clear_interrupted(out: str, say) -> None:
    """Removes the temporary folders that an interrupted export into `out` left beside it
    (a SIGKILL, a second signal, a power cut) when the process that made them is gone
    from this host; names any other one (`say`)."""
    parent, name = os.path.dirname(out) or ".", os.path.basename(out)
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    host = socket.gethostname()
    for entry in sorted(entries):
        if not entry.startswith(f".{name}.exporting-"):
            continue
        path = os.path.join(parent, entry)
        found = _EXPORTING.fullmatch(entry)
        if (found and found["name"] == name and found["host"] == host
                and _gone(int(found["pid"])) and not os.path.islink(path)):
            remove_tree(parent, entry, ignore_errors=True)
            say(f"tfllm: removed {path}, left by an interrupted export (pid "
                f"{found['pid']} is gone)")
        else:
            say(f"tfllm: note: {path} is an export's temporary folder, of a process that "
                "is still running or of another host or tfllm version; remove it once "
                "that export is over")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def written_atomically(out: str, say=_stderr):
    """Yields a new temporary folder next to `out` (checked by `require_new_folder`),
    renamed to `out` when the block succeeds (an empty `out` folder is replaced by the
    rename itself) and removed when it fails: only that folder, which this call made, is
    ever deleted. Its name holds this host and pid, so that when the process is killed
    before it can remove it, the next export into `out` does (`say` tells which).

    Args:
      out: the export's folder, from `require_new_folder`.
      say: receives one-line notes (default: printed to stderr).
    """
    parent = os.path.dirname(out) or "."
    _clear_interrupted(out, say)
    tmp = new_temporary_folder(f".{os.path.basename(out)}.exporting-{socket.gethostname()}-"
                               f"{os.getpid()}-", parent)
    try:
        yield tmp
    except BaseException:
        remove_tree(tmp, ignore_errors=True)
        raise
    replace(parent, tmp, out)
    _forget(tmp)
