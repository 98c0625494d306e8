"""Reading a committed checkpoint: verified files, and restore into any layout.

Integrity: COMMIT holds the sha256 of manifest.json, the manifest the sha256 and size of
every file, and each client's index the sha256 of every block. Small files are verified
whole; shards.bin files are size-checked (truncation) and each block is verified when it
is read, so a client reads and hashes only the blocks its devices need. sha256 rather
than a cheaper CRC: hashlib's runs at GB/s with the SHA CPU extensions and releases the
GIL (async saves hash in parallel with training).

What this protects against: corruption (a torn write, a truncated copy, a flipped bit).
Not tampering: whoever edits a file can recompute its sha256 and every hash above it, so
a checkpoint from someone else is input to trust like code. `signing` adds an optional
HMAC under a key of yours (TFLLM_CHECKPOINT_KEY) for that. Independently of any key,
every file name the manifest holds must have the form the writer gives it and stay inside
the checkpoint directory (`tfllm.confined`): a crafted manifest cannot make a reader open,
or a resumed run write, a file elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Dict, List

import numpy as np
import tensorflow as tf

from tfllm.checkpoint import signing
from tfllm.checkpoint.shards import (CheckpointError, assemble, assign_blocks, check_tiling,
                                     target_blocks, tf_variable)
from tfllm.checkpoint.storage import client_dir
from tfllm.confined import inside, open_regular, read_regular

# Every name `storage` writes into a manifest: nothing else is ever read.
_FILE_NAME = re.compile(r"^(metadata\.json|done\.\d{5}|"
                        r"client_\d{5}/(shards\.bin|index\.json|files/.+))$")
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_UNTRUSTED = ("the checkpoint was written by a buggy or malicious program: do not restore "
              "it, use another one")
#: COMMIT and manifest.json are a few KiB; the other small files (metadata.json,
#: index.json, done.*, a data iterator's state) are read whole, so each is bounded too
_COMMIT_BYTES, _MANIFEST_BYTES, _SMALL_FILE_BYTES = 1 << 16, 1 << 26, 1 << 28
#: the dtypes tfllm saves (weights, optimizer states, FP8 and loss-scale state, counters)
_DTYPES = frozenset(("float32", "float16", "bfloat16", "float64", "int32", "int64",
                     "float8_e4m3fn", "float8_e5m2", "bool", "uint8", "int8"))


#: the largest step and client count a manifest may name (whole numbers, no Infinity)
_MAX_STEP, _MAX_CLIENTS = 2 ** 53, 2 ** 16


def _no_constant(name):
    raise ValueError(f"{name} is no JSON number tfllm writes")


def _json(data: bytes):
    """Strict JSON of a checkpoint file: no NaN or Infinity, bounded nesting (a
    RecursionError becomes a ValueError)."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def _count(value, name: str, low: int, high: int) -> int:
    """`value` when it is a whole number (a JSON int, not a float or bool) in [low, high]."""
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} is {str(value)[:40]}, not a whole number from {low} to "
                         f"{high}")
    return value


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:160]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _numpy_dtype(name: str):
    return tf.as_dtype(name).as_numpy_dtype


class Reader:
    """A committed checkpoint opened for reading; every byte read is verified.

    Args:
      path: a committed checkpoint directory (DIR/step_XXXXXXXX).
    """

    def __init__(self, path: str):
        self.path = path
        commit_path = os.path.join(path, "COMMIT")
        try:
            commit = _json(self._read_file(commit_path, _COMMIT_BYTES, missing=True))
            if not isinstance(commit, dict):
                raise TypeError(f"a JSON {type(commit).__name__}, not an object")
            manifest_sha = commit["manifest_sha256"]
        except FileNotFoundError:
            raise CheckpointError(f"{commit_path}: missing; {path} is not a committed "
                                  "checkpoint (an interrupted save). Use "
                                  "tfllm.checkpoint.latest() to find a committed one.")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{commit_path}: corrupt ({e}).") from None
        manifest_path = os.path.join(path, "manifest.json")
        data = self._read_file(manifest_path, _MANIFEST_BYTES)
        if _sha(data) != manifest_sha:
            raise CheckpointError(f"{manifest_path}: sha256 differs from the one in COMMIT; "
                                  "the file is corrupt.")
        signing.check(commit, data, commit_path)
        try:
            manifest = _json(data)
            self.step = _count(manifest["step"], "step", 0, _MAX_STEP)
            self.num_clients = _count(manifest["num_clients"], "num_clients", 1,
                                      _MAX_CLIENTS)
            self.files: Dict[str, dict] = dict(manifest["files"])
            for info in self.files.values():
                if not (type(info["bytes"]) is int and info["bytes"] >= 0
                        and isinstance(info["sha256"], str)):
                    raise TypeError(f"a file entry {str(info)[:80]} lacks a count 'bytes' "
                                    "and a string 'sha256'")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{manifest_path}: malformed ({_short(e)}); "
                                  f"{_UNTRUSTED}.") from None
        dir_step = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
        if dir_step and int(dir_step.group(1)) != self.step:
            raise CheckpointError(f"{manifest_path}: holds step {self.step}, but the "
                                  f"directory is named for step {int(dir_step.group(1))}; "
                                  f"{_UNTRUSTED}.")
        self._paths = {rel: self._confine(rel, manifest_path) for rel in self.files}
        for rel, info in self.files.items():
            if rel.endswith("shards.bin"):  # truncation check without reading them
                full = self._paths[rel]
                try:  # a regular file: a FIFO or device is refused before it is opened
                    open_regular(full, info["bytes"], "a shard file", CheckpointError,
                                 _UNTRUSTED).close()
                    size = os.path.getsize(full)
                except FileNotFoundError:
                    size = None
                if size != info["bytes"]:
                    raise CheckpointError(f"{full}: {size} bytes, the manifest says "
                                          f"{info['bytes']}; the file is truncated or missing.")
        self.variables: Dict[str, dict] = {}
        for c in range(self.num_clients):
            index_path = f"{client_dir(c)}/index.json"
            try:
                index = _json(self.read(index_path))
                shards = f"{client_dir(c)}/shards.bin"
                for name, entry in index["variables"].items():
                    target = self.variables.setdefault(
                        name, {"shape": entry["shape"], "dtype": entry["dtype"], "blocks": []})
                    if (target["shape"], target["dtype"]) != (entry["shape"], entry["dtype"]):
                        raise ValueError(f"'{name}' has shape {str(entry['shape'])[:40]} "
                                         f"{str(entry['dtype'])[:20]} here, "
                                         f"{str(target['shape'])[:40]} "
                                         f"{str(target['dtype'])[:20]} in another client's")
                    for block in entry["blocks"]:
                        target["blocks"].append(dict(block, file=shards))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{os.path.join(path, index_path)}: malformed ({e}); "
                                      f"{_UNTRUSTED}.") from None
        for name, entry in self.variables.items():
            self._check_variable(name, entry)

    def _check_variable(self, name: str, entry: dict) -> None:
        """The index's entry of `name` is what a writer gives: a shape and dtype tfllm
        saves, blocks inside the shape that tile it (disjoint, covering), each block's
        bytes inside its shard file. Before any byte is read or allocated: a crafted index
        cannot make a restore read past a file, allocate absurd arrays, or leave part of a
        variable as uninitialized memory."""
        where = f"{self.path}: the index entry of '{name}'"
        shape, dtype = entry["shape"], entry["dtype"]
        if not (isinstance(shape, list) and len(shape) <= 8
                and all(type(n) is int and n >= 0 for n in shape)):
            raise CheckpointError(f"{where} has the shape {str(shape)[:60]}, not a list of "
                                  f"at most 8 sizes; {_UNTRUSTED}.")
        if not isinstance(dtype, str) or dtype not in _DTYPES:  # a dict is unhashable
            raise CheckpointError(f"{where} has the dtype {str(dtype)[:40]!r}, not one tfllm "
                                  f"saves; {_UNTRUSTED}.")
        itemsize = np.dtype(_numpy_dtype(dtype)).itemsize
        blocks = []
        for block in entry["blocks"]:
            start, size = block.get("start"), block.get("size")
            offset, nbytes = block.get("offset"), block.get("nbytes")
            fields = [*(start if isinstance(start, list) else [None]),
                      *(size if isinstance(size, list) else [None]), offset, nbytes]
            if not (all(type(n) is int and n >= 0 for n in fields)
                    and len(start) == len(size) == len(shape)
                    and isinstance(block.get("sha256"), str)):
                raise CheckpointError(f"{where} has a malformed block {str(block)[:80]}; "
                                      f"{_UNTRUSTED}.")
            if any(s + n > dim for s, n, dim in zip(start, size, shape)):
                raise CheckpointError(f"{where}: the block start={start} size={size} "
                                      f"reaches past its shape {shape}; {_UNTRUSTED}.")
            file_bytes = self.files.get(block["file"], {}).get("bytes", 0)
            if nbytes != math.prod(size) * itemsize or offset + nbytes > file_bytes:
                raise CheckpointError(f"{where}: the block start={start} size={size} says "
                                      f"{nbytes} bytes at offset {offset} of {block['file']} "
                                      f"({file_bytes} bytes in the manifest); {_UNTRUSTED}.")
            blocks.append((tuple(start), tuple(size)))
        problem = check_tiling(shape, blocks)
        if problem:
            raise CheckpointError(f"{where}: {problem}; {_UNTRUSTED}.")

    def _confine(self, rel, manifest_path: str) -> str:
        """The path of manifest entry `rel`, which must be a name the writer gives and
        resolve inside the checkpoint directory."""
        if not (isinstance(rel, str) and _FILE_NAME.match(rel)):
            raise CheckpointError(f"{manifest_path}: the file name {rel!r} is not one a "
                                  "checkpoint holds (metadata.json, done.NNNNN, "
                                  "client_NNNNN/{shards.bin,index.json,files/...}); "
                                  f"{_UNTRUSTED}.")
        return inside(self.path, rel, manifest_path, CheckpointError, fix=_UNTRUSTED)

    def file_path(self, rel: str) -> str:
        """The checked path of the checkpoint's file `rel` (a manifest entry)."""
        if rel not in self._paths:
            raise CheckpointError(f"{os.path.join(self.path, rel)}: not in the manifest.")
        return self._paths[rel]

    @staticmethod
    def _read_file(path: str, limit: int, missing: bool = False) -> bytes:
        """The bytes of `path`, a regular file of at most `limit` bytes (a FIFO or a
        device would block or never end); `missing`: a missing file raises
        FileNotFoundError (the caller names it)."""
        try:
            return read_regular(path, limit, "a checkpoint file", CheckpointError,
                                _UNTRUSTED)
        except FileNotFoundError:
            if missing:
                raise
            raise CheckpointError(f"{path}: cannot be read (missing).") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot be read ({e}).") from None

    def read(self, rel: str) -> bytes:
        """A whole small file of the checkpoint, checked against the manifest."""
        full = self.file_path(rel)
        info = self.files[rel]
        data = self._read_file(full, min(info["bytes"], _SMALL_FILE_BYTES))
        if len(data) != info["bytes"] or _sha(data) != info["sha256"]:
            raise CheckpointError(f"{full}: {len(data)} bytes with a sha256 that does not "
                                  f"match the manifest ({info['bytes']} bytes); the file is "
                                  "corrupt or truncated.")
        return data

    def metadata(self) -> dict:
        """metadata.json: a JSON object whose "step" (when there) is the manifest's, whose
        "config" and "tokenizer" (when there) are an object and a string; else a
        CheckpointError (a crafted checkpoint whose checksums were recomputed)."""
        path = os.path.join(self.path, "metadata.json")
        try:
            meta = _json(self.read("metadata.json"))
        except ValueError as e:
            raise CheckpointError(f"{path}: malformed ({_short(e)}); {_UNTRUSTED}.") from None
        problem = (f"a JSON {type(meta).__name__}, not an object" if not isinstance(meta, dict)
                   else f"its step {str(meta['step'])[:40]} is not the manifest's {self.step}"
                   if "step" in meta and (type(meta["step"]) is not int
                                          or meta["step"] != self.step)
                   else "its config is not an object" if "config" in meta
                   and not isinstance(meta["config"], dict)
                   else "its tokenizer fingerprint is not a string" if meta.get("tokenizer")
                   is not None and not isinstance(meta["tokenizer"], str) else None)
        if problem:
            raise CheckpointError(f"{path}: {problem}; {_UNTRUSTED}.")
        return meta

    def client_files(self, client_id: int) -> Dict[str, bytes]:
        """The per-client files saved by `client_id`, verified, as {name: bytes}; each
        name is a relative path (checked when the manifest was read)."""
        prefix = f"{client_dir(client_id)}/files/"
        return {rel[len(prefix):]: self.read(rel) for rel in sorted(self.files)
                if rel.startswith(prefix)}

    def read_block(self, name: str, i: int) -> np.ndarray:
        """Block i of variable `name` as an array of its size, checked against its sha256."""
        entry = self.variables[name]
        block = entry["blocks"][i]
        full = self.file_path(block["file"])
        try:
            with open_regular(full, None, "a shard file", CheckpointError, _UNTRUSTED) as f:
                f.seek(block["offset"])
                data = f.read(block["nbytes"])
        except (OSError, ValueError, TypeError) as e:  # also a negative or non-int offset
            raise CheckpointError(f"{full}: cannot be read ({e}).") from None
        if len(data) != block["nbytes"] or _sha(data) != block["sha256"]:
            raise CheckpointError(
                f"{full}: the block of '{name}' at byte {block['offset']} "
                f"({block['nbytes']} bytes) fails its sha256 check; the file is corrupt.")
        return np.frombuffer(data, dtype=_numpy_dtype(entry["dtype"])).reshape(block["size"])

    def check_names(self, variables: Dict[str, object], strict: bool = True) -> None:
        """Every variable is in the checkpoint with the same shape and dtype, and (when
        `strict`) vice versa; strict=False restores a subset, e.g. only the model."""
        missing = sorted(set(variables) - set(self.variables))
        extra = sorted(set(self.variables) - set(variables)) if strict else []
        if missing or extra:
            raise CheckpointError(
                f"{self.path}: the variables do not match the checkpoint: missing from the "
                f"checkpoint {missing[:10]}{' ...' if len(missing) > 10 else ''}, unexpected "
                f"in the checkpoint {extra[:10]}{' ...' if len(extra) > 10 else ''}; restore "
                "with the model, optimizer and precision settings that saved it.")
        for name, var in variables.items():
            var = tf_variable(var, name)
            saved = self.variables[name]
            shape, dtype = [int(n) for n in var.shape], var.dtype.name
            if saved["shape"] != shape or saved["dtype"] != dtype:
                raise CheckpointError(
                    f"{name}: the checkpoint holds shape {saved['shape']} dtype "
                    f"{saved['dtype']}, the variable has shape {shape} dtype {dtype}; the "
                    "model config differs from the one that saved it.")

    def restore(self, variables: Dict[str, object], strict: bool = True) -> None:
        """Assigns every variable its saved global value, in the variable's own layout.

        All blocks are read and verified before anything is assigned, so a corrupt
        checkpoint leaves the variables untouched.
        """
        self.check_names(variables, strict)
        pending = []
        for name in sorted(variables):
            var = tf_variable(variables[name], name)
            # A set: replicas on several local devices share a block, built once.
            pending.append((var, self.blocks(name, {block for _, block in target_blocks(var)})))
        for var, arrays in pending:
            assign_blocks(var, arrays)

    def blocks(self, name: str, wanted) -> Dict[tuple, np.ndarray]:
        """{(start, size): array} of variable `name` for each wanted block, assembled
        from the saved blocks that overlap it (each saved block read and verified once)."""
        entry = self.variables[name]
        saved = [(tuple(b["start"]), tuple(b["size"])) for b in entry["blocks"]]
        cache: Dict[int, np.ndarray] = {}

        def read(i):
            if i not in cache:
                cache[i] = self.read_block(name, i)
            return cache[i]
        return {block: assemble(block, saved, read, _numpy_dtype(entry["dtype"]), name)
                for block in wanted}

    def whole(self, name: str) -> np.ndarray:
        """Variable `name`'s global value, whichever clients and layout saved it."""
        shape = tuple(int(n) for n in self.variables[name]["shape"])
        block = ((0,) * len(shape), shape)
        return self.blocks(name, [block])[block]


def open_checkpoint(path: str) -> Reader:
    return Reader(path)


def verify(path: str) -> List[str]:
    """Checks every file of a checkpoint in full; returns the files checked.

    Raises CheckpointError naming the first bad file.
    """
    reader = Reader(path)
    for rel, info in reader.files.items():
        if rel.endswith("shards.bin"):
            h, full = hashlib.sha256(), reader.file_path(rel)
            with open(full, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            if h.hexdigest() != info["sha256"]:
                raise CheckpointError(f"{full}: sha256 does not match the manifest; the "
                                      "file is corrupt.")
        else:
            reader.read(rel)
    return sorted(reader.files)

