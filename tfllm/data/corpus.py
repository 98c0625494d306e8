"""The embedded default corpus: this Python's own standard library, built offline.

Every machine that runs tfllm already has tens of MB of real text: the standard
library's source files (code, docstrings, comments) and its .txt/.rst files. The corpus
is built from them deterministically and cached under `data.data_dir`:

    DATA_DIR/corpus/py3.11.7/{train,validation}.tfrecord + manifest.json

A document is one file (relative path sorted, read as UTF-8; files that do not decode
are skipped, the same ones on every machine with the same Python). The split is by a
SHA-256 of the relative path, so it never overlaps and does not depend on file order.
Each split is a TFRecord file of tf.train.Example records with one bytes feature
`text` (the format `source=tfrecord` reads). The text is under the PSF license of the
user's own Python installation; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from tfllm import files
from tfllm.confined import inside, open_regular, read_regular
from tfllm.data.errors import DataError

SUFFIXES = (".py", ".txt", ".rst")
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# Manifests verified in this process: every row stream of a batch asks for the corpus,
# and verifying reads all of it.
_BUILT: Dict[str, Tuple] = {}


def _signature(directory: str) -> Optional[Tuple]:
    """Sizes and modification times of the cache files: a cheap "unchanged" check."""
    try:
        return tuple((os.path.getsize(p), os.stat(p).st_mtime_ns) for p in (
            os.path.join(directory, n) for n in (MANIFEST, "train.tfrecord",
                                                 "validation.tfrecord")))
    except OSError:
        return None


def stdlib_root() -> str:
    """The directory of this Python's standard library."""
    return sysconfig.get_paths()["stdlib"]


def in_validation(relpath: str, validation_fraction: float) -> bool:
    """Whether a document goes to validation: a stable hash of its path, not its order."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < validation_fraction


def list_documents(root: str) -> List[Tuple[str, str]]:
    """(relative path, text) of every UTF-8 document under `root`, sorted by path.

    Args:
      root: the standard-library directory (a parameter so that tests can use a small one).
    """
    docs = []
    for directory, dirs, files in os.walk(root):
        # Sorting in place fixes os.walk's order, which is the file system's.
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(SUFFIXES):
                continue
            path = os.path.join(directory, name)
            try:
                with open(path, "rb") as f:
                    text = f.read().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # test fixtures in other encodings; skipped the same way everywhere
            if text.strip():
                docs.append((os.path.relpath(path, root).replace(os.sep, "/"), text))
    docs.sort()
    return docs


def _example(text: str) -> bytes:
    feature = tf.train.Feature(bytes_list=tf.train.BytesList(value=[text.encode("utf-8")]))
    return tf.train.Example(
        features=tf.train.Features(feature={"text": feature})).SerializeToString()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open_regular(path, None, "a corpus cache file") as f:  # no FIFO, no device
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_dir(data_dir: str, validation_fraction: float) -> str:
    version = ".".join(map(str, sys.version_info[:3]))
    return os.path.join(os.path.expanduser(data_dir), "corpus",
                        f"py{version}-val{validation_fraction:g}")


def _valid(directory: str) -> Optional[Dict]:
    """The manifest if the cache is complete and its files match their checksums."""
    try:  # the cache is shared (data.data_dir): its manifest is read bounded, its file
        # names kept inside the cache; anything else is no cache (rebuilt)
        manifest = json.loads(read_regular(os.path.join(directory, MANIFEST), 1 << 20,
                                           "the corpus cache's manifest"))
        if manifest.get("format") != FORMAT_VERSION:
            return None
        for split in ("train", "validation"):
            info = manifest["splits"][split]
            path = inside(directory, info["file"], "the corpus cache's manifest", flat=True)
            if os.path.getsize(path) != info["file_bytes"] or _sha256(path) != info["sha256"]:
                return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def build_corpus(data_dir: str = "~/.cache/tfllm", validation_fraction: float = 0.02,
                 root: Optional[str] = None) -> Dict:
    """Builds (or reuses) the cached corpus; returns its manifest with absolute paths.

    The manifest records the Python version, document/byte counts and SHA-256 of each
    split file. It is written last and atomically, so a half-built cache is never used:
    a missing or corrupt cache is rebuilt.

    Args:
      data_dir: cache root (data.data_dir); `~` is expanded.
      validation_fraction: share of documents held out (data.validation_fraction).
      root: directory to read; defaults to this Python's standard library.

    Returns:
      dict with `train` and `validation` (TFRecord paths), `splits` (per-split `docs`,
      `text_bytes`, `file_bytes`, `sha256`), `python`, `root` and `dir`.
    """
    root = root or stdlib_root()
    directory = _cache_dir(data_dir, validation_fraction)
    if root != stdlib_root():  # a custom root (tests) gets its own cache entry
        directory += "-" + hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:12]
    memo = _BUILT.get(directory)
    manifest = (dict(memo[1]) if memo and memo[0] == _signature(directory)
                else _valid(directory))
    if manifest is None:
        manifest = _write(directory, root, validation_fraction)
    _BUILT[directory] = (_signature(directory), dict(manifest))
    for split in ("train", "validation"):
        manifest[split] = os.path.join(directory, manifest["splits"][split]["file"])
    manifest["dir"] = directory
    return manifest


def _write(directory: str, root: str, validation_fraction: float) -> Dict:
    docs = list_documents(root)
    if not docs:
        raise DataError(f"data.source=corpus: no UTF-8 .py/.txt/.rst files under {root}; "
                        "use data.source=text with data.paths instead.")
    splits = {"train": [], "validation": []}
    for relpath, text in docs:
        splits["validation" if in_validation(relpath, validation_fraction) else "train"]\
            .append(text)
    if validation_fraction > 0 and not splits["validation"]:
        splits["validation"].append(splits["train"].pop())  # tiny roots: keep one doc
    manifest = {"format": FORMAT_VERSION, "python": sys.version.split()[0], "root": root,
                "validation_fraction": validation_fraction, "splits": {}}
    # TensorFlow writes by path: into a new folder of this process's, in the cache folder
    # (the root of these writes), each file then renamed into place
    with files.temporary_folder(".building-", directory) as tmp:
        for split, texts in splits.items():
            name = f"{split}.tfrecord"
            with tf.io.TFRecordWriter(os.path.join(tmp, name)) as writer:
                for text in texts:
                    writer.write(_example(text))
            path = os.path.join(directory, name)
            files.replace(directory, os.path.join(tmp, name), path)
            manifest["splits"][split] = {
                "file": name, "docs": len(texts), "file_bytes": os.path.getsize(path),
                "text_bytes": sum(len(t.encode("utf-8")) for t in texts),
                "sha256": _sha256(path)}
    files.write_atomically(directory, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True),
                           suffix=f".{os.getpid()}.tmp")
    return manifest
