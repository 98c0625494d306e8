"""File names read from files (a checkpoint's manifest, a preset's weight map) kept inside
their directory: the one rule, for reading and writing alike.

A name written by someone else decides which file tfllm opens (or, restoring a data
iterator, writes). `relative_name` accepts only a plain relative path: no absolute path,
no `..`, `.` or empty component, no backslash or NUL, and with `flat=True` no separator
at all. `inside` then joins it to its directory and checks that the resolved path
(symlinks followed) is still inside the resolved directory, so a symlink planted in the
directory cannot lead out either.

Both take the caller's error class, so a checkpoint's bad name is a `CheckpointError` and
a preset's a `PretrainedError` (one line and exit 2 at the command line).
"""

from __future__ import annotations

import os


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
