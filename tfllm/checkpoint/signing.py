"""Optional authenticity: an HMAC-SHA256 of manifest.json under a key only you hold.

The sha256 chain (COMMIT -> manifest.json -> every file and block) catches corruption, not
tampering: whoever edits a file can recompute its hash and every hash above it. With
`TFLLM_CHECKPOINT_KEY` set, the save writes `manifest_hmac_sha256` into COMMIT, and every
read refuses a checkpoint whose manifest does not carry a matching HMAC under that key;
as the manifest holds the sha256 of every file (and each index.json that of every
block), the HMAC authenticates all of it. Every client of a job needs the same key. Unset,
nothing is signed or checked (a signed checkpoint still reads).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Optional

from tfllm.checkpoint.shards import CheckpointError

ENV = "TFLLM_CHECKPOINT_KEY"
FIELD = "manifest_hmac_sha256"


def key() -> Optional[bytes]:
    """The signing key from the environment, or None when unset or empty."""
    value = os.environ.get(ENV, "")
    return value.encode() if value else None


def sign(manifest: bytes) -> dict:
    """The COMMIT fields that sign `manifest` ({} without a key)."""
    k = key()
    return {FIELD: hmac.new(k, manifest, hashlib.sha256).hexdigest()} if k else {}


def check(commit: dict, manifest: bytes, commit_path: str) -> None:
    """Raises CheckpointError when a key is set and `commit` does not sign `manifest`."""
    k = key()
    if k is None:
        return
    signature = commit.get(FIELD)
    if not isinstance(signature, str):
        raise CheckpointError(f"{commit_path}: the checkpoint is not signed, but {ENV} is set; "
                              "it was saved without the key (or by someone else). Restore it "
                              f"only if you trust where it came from, with {ENV} unset.")
    expected = hmac.new(k, manifest, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature, expected):
        raise CheckpointError(f"{commit_path}: the signature does not match {ENV}: the "
                              "checkpoint was changed after it was saved, or saved with "
                              "another key; do not restore it.")
