"""File names read from files (a checkpoint's manifest, a preset's weight map) kept inside
their directory, and files read only when regular and bounded: the one rule for reading.

A name written by someone else decides which file tfllm opens (or, restoring a data
iterator, writes). `relative_name` accepts only a plain relative path: no absolute path,
no `..`, `.` or empty component, no backslash or NUL, and with `flat=True` no separator
at all. `inside` then joins it to its directory and checks that the resolved path
(symlinks followed) is still inside the resolved directory, so a symlink planted in the
directory cannot lead out either.

Both take the caller's error class, so a checkpoint's bad name is a `CheckpointError` and
a preset's a `PretrainedError` (one line and exit 2 at the command line).

What such a path names is bounded too: `open_regular` and `read_regular` open it only when
it is a regular file of at most a given size, checked on the opened descriptor (no race
with a rename), and without blocking: a FIFO, a device such as /dev/zero, a socket or a
directory is refused before a byte is read, where reading it would block forever or
until memory runs out.

What an export copies out of a run must be the run's own: `within` and `tree_within`
refuse a path (or a folder holding one) that a link leads out of the run, naming it.

This module only reads; every write and delete goes through `tfllm.files`.
"""

from __future__ import annotations

import os
import stat


def relative_name(name, what: str, error=ValueError, flat: bool = False,
                  fix: str = "rename it") -> str:
    """`name` when it is a plain relative path (a plain file name with `flat`), else raises.

    Args:
      name: the name as read (any type: a non-string is refused too).
      what: where the name comes from, for the message (e.g. ".../manifest.json").
      error: the exception class to raise.
      flat: a file name in the directory itself; no '/' allowed.
      fix: what the user should do, ending the message.

    Returns:
      `name`, unchanged ('/'-separated).
    """
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts) \
            or (flat and len(parts) > 1):
        form = ("a plain file name in its directory (no '/', '\\' or '..')" if flat else
                "a relative path inside its directory (no '..', '.', empty or absolute part, "
                "no '\\'), such as 'data/iterator.json'")
        raise error(f"{what}: {name!r} is not {form}; {fix}.")
    return name


def inside(directory: str, name, what: str, error=ValueError, flat: bool = False,
           fix: str = "rename it", root=None) -> str:
    """`directory/name` after checking the name (`relative_name`) and that the resolved path
    stays inside the resolved `directory` (a symlink out of it is refused).

    Args:
      root: a directory that contains `directory` and that links may lead into (default:
        `directory` itself), e.g. a Hugging Face cache repository whose snapshot folders
        hold links into its `blobs/`.

    Returns:
      The joined path (not resolved).
    """
    path = os.path.join(directory, relative_name(name, what, error, flat, fix))
    root, real = os.path.realpath(root or directory), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise error(f"{what}: {name!r} resolves to {real}, outside {root} (a symlink); tfllm "
                    "uses only files inside the directory: replace the link by the file it "
                    "names (cp -rL copies a folder with its links resolved).")
    return path


def within(path: str, root: str, what: str, error=ValueError) -> str:
    """`path` when it resolves (links followed) inside `root`, else raises `error` naming
    where it leads: what an export copies out of a run must be the run's own."""
    top, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([top, real]) != top:
        raise error(f"{path} leads to {real}, outside {root} (a symbolic link); {what} "
                    "only the run's own files: replace the link by the file or folder it "
                    "names (cp -rL), then run the command again.")
    return path


def tree_within(folder: str, root: str, what: str, error=ValueError) -> str:
    """`folder` when it and everything in it resolve inside `root` (`within`), walked
    through links (each real folder once); returns `folder`."""
    seen = set()
    for current, folders, names in os.walk(within(folder, root, what, error),
                                           followlinks=True):
        real = os.path.realpath(within(current, root, what, error))
        if real in seen:
            folders[:] = []
            continue
        seen.add(real)
        for name in names:
            within(os.path.join(current, name), root, what, error)
    return folder


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def open_regular(path: str, limit, what: str, error=ValueError, fix: str = ""):
    """`path` opened for reading (binary) when it is a regular file of at most `limit`
    bytes (None: any size); else raises `error` naming the path, what it is and `fix`.

    Args:
      what: what the file should be, for the message (e.g. "a SentencePiece model").
    Raises:
      OSError as `os.open` does (a missing file: FileNotFoundError).
    """
    # O_NONBLOCK: opening a FIFO for reading would wait for a writer; it is refused below.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        tail = f"; {fix}" if fix else ""
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "no regular file")
            raise error(f"{path}: is {kind}, not a regular file; {what} must be a file{tail}.")
        if limit is not None and st.st_size > limit:
            raise error(f"{path}: {st.st_size} bytes, more than {what} holds (at most "
                        f"{limit}){tail}.")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, limit, what: str, error=ValueError, fix: str = "") -> bytes:
    """The bytes of `path` when it is a regular file of at most `limit` bytes
    (`open_regular`); a file that grows past `limit` while read is refused too."""
    with open_regular(path, limit, what, error, fix) as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise error(f"{path}: more than {limit} bytes (it grew while read), more than "
                    f"{what} holds.")
    return data
