"""Writing a checkpoint directory: per-client shard files, the file barrier and the commit.

Assumes one filesystem shared by every client (NFS, Lustre, GCS-fuse with close-to-open
consistency, or a local disk for a single host): clients write disjoint files into one
temporary directory and client 0 commits it. Layout of a committed checkpoint:

    DIR/step_00000010/
      COMMIT                 written last: {"step", "nonce", "manifest_sha256"} (and
                             "manifest_hmac_sha256" with TFLLM_CHECKPOINT_KEY, see signing)
      manifest.json          every file below with its sha256 and size, num_clients
      metadata.json          the caller's JSON metadata (+ "step")
      done.00000 ...         each client's list of its files (the barrier tokens)
      client_00000/
        shards.bin           raw bytes of this client's shards, concatenated
        index.json           variable -> global shape, dtype, blocks (start, size,
                             offset, nbytes, sha256 of the block's bytes)
        files/...            the caller's per-client files (e.g. the data-iterator state)
      client_00001/ ...

Save protocol: every client writes into `DIR/step_00000010.tmp-<nonce>/` (the nonce is
agreed by one tiny all-reduce, so a stale directory of a crashed attempt at the same step
is never mixed in), fsyncs its files, then publishes `done.<client>` by an atomic rename.
Client 0 waits for all `done.*` (with a timeout), writes metadata.json and manifest.json,
renames the directory to `DIR/step_00000010/` and writes COMMIT last. Only directories
holding a COMMIT are ever restored; anything else is garbage that `cleanup` removes.
When client 0's part fails it leaves `FAILED` in the temporary directory (`FAILED.io` when
the storage failed), and the others fail at once, as it does (`mark_failed`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from tfllm import files
from tfllm.checkpoint import signing
from tfllm.checkpoint.shards import CheckpointError

FORMAT = 1
#: client 0's sign to the clients waiting for its commit that the save failed; the I/O
#: name when the storage failed
FAILED, FAILED_IO = "FAILED", "FAILED.io"
_COMMITTED = re.compile(r"^step_(\d{8})$")
_POLL_S = 0.05


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def client_dir(client_id: int) -> str:
    return f"client_{client_id:05d}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(root: str, path: str, data: bytes) -> dict:
    """Writes `data` durably (write, flush, fsync) to `path` inside `root` (a link on the
    way or at the name is refused: `tfllm.files`); returns its {sha256, bytes}."""
    with files.open_for_writing(root, path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def write_json_atomic(root: str, path: str, obj) -> dict:
    """A JSON file inside `root` that readers see whole or not at all (written durably to
    .part, then renamed); returns its {sha256, bytes}."""
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    files.write_atomically(root, path, data, suffix=".part", durable=True)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _raw(array: np.ndarray) -> np.ndarray:
    """The bytes of an array in C order, as uint8 (works for bfloat16 and float8 too)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def write_client(tmp: str, client_id: int, variables: Dict[str, dict],
                 client_files: Dict[str, bytes]) -> None:
    """Writes this client's shards, index and files, then its `done.<client>` token.

    Args:
      tmp: the shared temporary checkpoint directory.
      client_id: this client.
      variables: name -> {"shape", "dtype", "blocks": [((start, size), array)], or a
        callable returning that list, called when the variable is written}.
      client_files: relative name -> bytes, stored under client_XXXXX/files/.
    """
    rel = client_dir(client_id)
    root = os.path.dirname(tmp)  # the checkpoints folder: the save's folder is walked too
    files.make_dirs(root, os.path.join(tmp, rel, "files"))
    listing, index = {}, {}
    data_hash, offset = hashlib.sha256(), 0
    with files.open_for_writing(root, os.path.join(tmp, rel, "shards.bin"), "wb") as f:
        for name in sorted(variables):
            entry = variables[name]
            owned = entry["blocks"]() if callable(entry["blocks"]) else entry["blocks"]
            blocks = []
            for (start, size), array in owned:
                raw = _raw(array)
                f.write(raw)
                data_hash.update(raw)
                blocks.append({"start": list(start), "size": list(size), "offset": offset,
                               "nbytes": int(raw.size),
                               "sha256": hashlib.sha256(raw).hexdigest()})
                offset += int(raw.size)
            index[name] = {"shape": list(entry["shape"]), "dtype": entry["dtype"],
                           "blocks": blocks}
        f.flush()
        os.fsync(f.fileno())
    listing[f"{rel}/shards.bin"] = {"sha256": data_hash.hexdigest(), "bytes": offset}
    listing[f"{rel}/index.json"] = write_file(
        root, os.path.join(tmp, rel, "index.json"),
        json.dumps({"format": FORMAT, "client": client_id, "variables": index},
                   sort_keys=True).encode())
    for name, data in sorted(client_files.items()):
        path = os.path.join(tmp, rel, "files", name)  # its folders made on the way
        listing[f"{rel}/files/{name}"] = write_file(root, path, data)
    _fsync_dir(os.path.join(tmp, rel))
    write_json_atomic(root, os.path.join(tmp, f"done.{client_id:05d}"),
                      {"client": client_id, "files": listing})


def wait_for(predicate, timeout_s: float, what: str):
    """Polls `predicate` until it returns a true value, or raises after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckpointError(f"timed out after {timeout_s:.0f} s waiting for {what}; a "
                                  "client died or the filesystem is not shared by all "
                                  "clients (Checkpointer(barrier_timeout_s=...) sets the "
                                  "limit).")
        time.sleep(_POLL_S)


def commit(directory: str, tmp: str, step: int, nonce: str, num_clients: int,
           metadata: dict, timeout_s: float) -> str:
    """Client 0: waits for every client's done token, writes the manifest, commits.

    Returns:
      The committed checkpoint's path.
    """
    tokens = [os.path.join(tmp, f"done.{c:05d}") for c in range(num_clients)]
    wait_for(lambda: all(os.path.exists(t) for t in tokens), timeout_s,
             f"the done.* tokens of {num_clients} clients in {tmp}")
    listing = {}
    for token in tokens:
        with open(token, "rb") as f:
            data = f.read()
        listing.update(json.loads(data)["files"])
        listing[os.path.basename(token)] = {"sha256": hashlib.sha256(data).hexdigest(),
                                            "bytes": len(data)}
    listing["metadata.json"] = write_file(
        directory, os.path.join(tmp, "metadata.json"),
        json.dumps(metadata, indent=1, sort_keys=True).encode())
    manifest = {"format": FORMAT, "step": step, "num_clients": num_clients, "files": listing}
    manifest = json.dumps(manifest, indent=1, sort_keys=True).encode()
    manifest_info = write_file(directory, os.path.join(tmp, "manifest.json"), manifest)
    _fsync_dir(tmp)
    final = os.path.join(directory, step_name(step))
    old = None
    if os.path.lexists(final):
        # Saving a step that already exists (e.g. a rerun after restoring it): move the old
        # one aside first; until COMMIT lands the previous step is the latest, never a mix.
        # (A link named like it is refused: it is not this run's.)
        old = final + f".replaced-{nonce}"
        files.replace(directory, final, old)
    files.replace(directory, tmp, final)
    _fsync_dir(directory)
    write_json_atomic(directory, os.path.join(final, "COMMIT"),
                      {"step": step, "nonce": nonce,
                       "manifest_sha256": manifest_info["sha256"], **signing.sign(manifest)})
    if old is not None:
        files.remove_tree(directory, old, ignore_errors=True)
    return final


def wait_committed(directory: str, tmp: str, step: int, nonce: str, timeout_s: float) -> None:
    """Clients other than 0: return once client 0 committed this very save (same nonce).

    Raises:
      CheckpointError: client 0 marked the save failed (`mark_failed`); raised from an
        OSError when the storage failed, so that every client exits as client 0 does
        (74, tfllm.contracts), or after `timeout_s`.
    """
    marker = os.path.join(directory, step_name(step), "COMMIT")

    def done():
        _raise_if_failed(tmp, step)
        try:
            with open(marker) as f:
                return json.load(f).get("nonce") == nonce
        except (OSError, ValueError):
            return False
    wait_for(done, timeout_s, f"client 0 to commit {marker}")


def mark_failed(tmp: str, error: BaseException, io_error: Optional[OSError] = None) -> None:
    """Client 0: tells the clients in `wait_committed` at once (not at their timeout) that
    the save failed, and whether the storage failed: in the marker's name, which a full
    disk still lets be created when it refuses the text.

    Args:
      tmp: the save's temporary directory.
      error: why the save failed.
      io_error: the OSError of a failed storage (`tfllm.contracts.io_failure`), or None.
    """
    record = {"error": str(error) or type(error).__name__}
    if io_error is not None:
        record.update(errno=io_error.errno, strerror=io_error.strerror)
    marker = os.path.join(tmp, FAILED_IO if io_error is not None else FAILED)
    root = os.path.dirname(tmp)
    try:  # the text first, then the name: a waiting client never reads a half-written marker
        files.write_atomically(root, marker, json.dumps(record), suffix=".part")
    except (OSError, files.Refused):  # a full disk may refuse the text, not the name
        try:
            files.open_for_writing(root, marker, "a", append=True).close()
        except (OSError, files.Refused):
            pass  # without the name the others time out


def _raise_if_failed(tmp: str, step: int) -> None:
    for name in (FAILED_IO, FAILED):
        path = os.path.join(tmp, name)
        if not os.path.exists(path):
            continue
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):  # its text lost to the failing storage
            record = {}
        record = record if isinstance(record, dict) else {}
        error = CheckpointError(f"{path}: client 0 failed to commit step {step}: "
                                f"{record.get('error', 'no details were written')}")
        if name == FAILED:
            raise error
        code = record.get("errno")
        code = code if isinstance(code, int) else errno.EIO
        raise error from OSError(code, record.get("strerror") or os.strerror(code))


def committed(directory: str) -> List[Tuple[int, str]]:
    """(step, path) of every committed checkpoint in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _COMMITTED.match(name)
        path = os.path.join(directory, name)
        # a link named like a checkpoint (to another run's) is not one of this run's
        if m and not os.path.islink(path) and os.path.isfile(os.path.join(path, "COMMIT")):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest(directory: str) -> Optional[str]:
    """The newest committed checkpoint's path, or None. Partial ones are never chosen."""
    steps = committed(directory)
    return steps[-1][1] if steps else None


def delete(path: str) -> None:
    """Removes a checkpoint: COMMIT first, so a half-deleted one is never restored. A
    symbolic link named like a checkpoint is not tfllm's: never followed or removed (nor
    is anything not named as tfllm names checkpoints: `tfllm.files`)."""
    if os.path.islink(path):
        return
    root = os.path.dirname(path)
    with contextlib.suppress(files.Refused):  # a COMMIT that is a link goes with its folder
        files.remove(root, os.path.join(path, "COMMIT"))
    files.remove_tree(root, path, ignore_errors=True)


def cleanup(directory: str) -> List[str]:
    """Removes uncommitted checkpoint directories (crashed or partial saves).

    Call on client 0 only, at start, before any save of this run (the other clients do not
    write before client 0 reaches its first save: the save begins with a collective).

    Returns:
      The removed paths.
    """
    if not os.path.isdir(directory):
        return []
    keep = {path for _, path in committed(directory)}
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if (name.startswith("step_") and files.owned_name(name) and os.path.isdir(path)
                and not os.path.islink(path) and path not in keep):
            delete(path)
            removed.append(path)
    return removed


def prune(directory: str, max_to_keep: int) -> List[str]:
    """Deletes the oldest committed checkpoints beyond `max_to_keep` (client 0 only)."""
    old = committed(directory)[:-max_to_keep] if max_to_keep > 0 else []
    for _, path in old:
        delete(path)
    return [p for _, p in old]
