"""Variables <-> host blocks: which shards this client owns, and how to refill any layout.

A saved variable is a set of blocks `(start, size)` of its global array. On save each
client takes only its local devices' shards, and of the replicas of one shard (devices
that differ only along mesh axes the layout does not use) exactly one writes it, chosen
by a rule every client evaluates alike (`is_writer`): every distinct shard is written
once in the whole job, with no communication, and the bytes spread over the clients.
On restore each local device of the *target* layout gets its block assembled from the
saved blocks that overlap it, so the target mesh need not match the one that saved.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Dict, List, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfllm import internals
from tfllm.parallel.placement import local_blocks

Block = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (start, size)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the variables it restores into;
    the message names the file or variable and the fix."""


def tf_variable(var, name: str = "variable"):
    """The tf.Variable / DVariable behind a Keras or TF variable.

    Args:
      var: a `keras.Variable` (Keras 3 keeps the TF variable in `.value`) or a tf.Variable.
      name: the checkpoint name, for the error message.
    """
    if isinstance(var, keras.Variable):
        if not internals.is_allocated(var):
            raise CheckpointError(f"{name}: the Keras variable {var.path} is not initialized; "
                                  "build the model (tfllm.models.build_model) before saving "
                                  "or restoring it.")
        var = var.value
    if not isinstance(var, tf.Variable):
        raise CheckpointError(f"{name}: {type(var).__name__} is not a variable; pass "
                              "keras.Variable, tf.Variable or dtensor.DVariable values.")
    return var


def layout_of(var):
    """(mesh, spec) of a DVariable, or (None, None) for a plain single-device variable."""
    try:
        layout = dtensor.fetch_layout(var)
    except Exception:  # not a DTensor: a plain tf.Variable
        return None, None
    spec = tuple(None if s == dtensor.UNSHARDED else s for s in layout.sharding_specs)
    return layout.mesh, spec


def _global_shape(var) -> Tuple[int, ...]:
    return tuple(int(n) for n in var.shape)


def is_writer(mesh, spec, loc: Dict[str, int], salt: int) -> bool:
    """Whether the device at mesh location `loc` writes its shard of a tensor laid out by
    `spec`: exactly one of the replicas of each distinct shard does.

    The replicas of a shard differ only along the mesh axes `spec` does not use. Rather
    than always the first replica (which in data parallelism across hosts would make
    client 0 write the whole model), the writer rotates with the shard's index and a
    per-variable salt, spreading the bytes evenly over the replicas' clients.
    """
    used = [a for a in mesh.dim_names if a in spec]
    unused = [a for a in mesh.dim_names if a not in spec]
    shard, replica, replicas = 0, 0, 1
    for a in used:
        shard = shard * mesh.dim_size(a) + loc[a]
    for a in unused:
        replica = replica * mesh.dim_size(a) + loc[a]
        replicas *= mesh.dim_size(a)
    return replica == (shard + salt) % replicas


def owned_blocks(var, client_id: int, copy: bool,
                 name: str = "") -> List[Tuple[Block, np.ndarray]]:
    """The shards of `var` this client must write: ((start, size), host array) pairs.

    Args:
      var: a tf.Variable or DVariable.
      name: the checkpoint name (salts which replica writes, see `is_writer`).
      client_id: this client (a plain variable is written by client 0 only).
      copy: copy out of TF's buffers (needed when the write happens later, in a thread,
        while training goes on and may reuse the buffers).
    """
    mesh, spec = layout_of(var)
    shape = _global_shape(var)
    value = var.read_value()
    if mesh is None:
        if client_id != 0:
            return []
        host = value.numpy()
        return [((tuple([0] * len(shape)), shape), np.array(host, copy=True) if copy else host)]
    blocks = local_blocks(mesh, shape, list(spec))
    salt = zlib.crc32(name.encode())
    out = []
    for part, (_, start, size), loc in zip(dtensor.unpack(value), blocks,
                                           mesh.local_device_locations()):
        if not is_writer(mesh, spec, loc, salt):
            continue  # a replica of a shard that another device writes
        host = part.numpy()
        out.append(((tuple(start), tuple(size)), np.array(host, copy=True) if copy else host))
    return out


def target_blocks(var) -> List[Tuple[str, Block]]:
    """(device, (start, size)) of each local shard of `var`'s layout ("" for plain)."""
    mesh, spec = layout_of(var)
    shape = _global_shape(var)
    if mesh is None:
        return [("", (tuple([0] * len(shape)), shape))]
    return [(device, (tuple(start), tuple(size)))
            for device, start, size in local_blocks(mesh, shape, list(spec))]


def _overlap(a: Block, b: Block):
    """The intersection of two blocks as (start, size), or None."""
    start = tuple(max(s1, s2) for s1, s2 in zip(a[0], b[0]))
    end = tuple(min(s1 + n1, s2 + n2) for s1, n1, s2, n2 in zip(a[0], a[1], b[0], b[1]))
    if any(e <= s for s, e in zip(start, end)):
        return None
    return start, tuple(e - s for s, e in zip(start, end))


def _covered(block: Block) -> int:
    return int(np.prod(block[1], dtype=np.int64))


def check_tiling(shape: Sequence[int], blocks: Sequence[Block]) -> str:
    """Why `blocks` (each inside `shape`) do not tile the array of `shape` exactly once,
    or "" when they do: no two overlap, and together they cover every element.

    Saved blocks never overlap (one writer per distinct shard, see `is_writer`); blocks
    that overlapped, or left a gap, would restore some elements twice and others never
    (as uninitialized memory)."""
    boxes = [(np.array(s, dtype=np.int64), np.array(s, dtype=np.int64) + np.array(n, np.int64))
             for s, n in blocks if all(n)]  # empty blocks cover nothing
    if boxes:
        starts, ends = np.array([b[0] for b in boxes]), np.array([b[1] for b in boxes])
        for i in range(len(boxes) - 1):  # a pair overlaps when it does on every dimension
            hit = np.all((starts[i + 1:] < ends[i]) & (starts[i] < ends[i + 1:]), axis=1)
            if hit.any():
                j = i + 1 + int(np.argmax(hit))
                return (f"the blocks start={starts[i].tolist()} and start={starts[j].tolist()} "
                        "overlap")
    covered = sum(math.prod(n) for _, n in blocks)
    if covered != math.prod(shape):
        return f"the blocks cover {covered} of its {math.prod(shape)} elements"
    return ""


def assemble(target: Block, saved: Sequence[Block], read: Callable[[int], np.ndarray],
             dtype, name: str) -> np.ndarray:
    """Builds the `target` block from the saved blocks that overlap it.

    Args:
      target: (start, size) wanted.
      saved: (start, size) of every saved block of the variable.
      read: returns saved block i as an array of its size (verified, read once).
      dtype: numpy dtype of the result.
      name: the variable, for errors.
    """
    out = np.empty(target[1], dtype=dtype)
    filled = 0
    for i, block in enumerate(saved):
        common = _overlap(target, block)
        if common is None:
            continue
        src = tuple(slice(c - s, c - s + n) for c, s, n in zip(common[0], block[0], common[1]))
        dst = tuple(slice(c - s, c - s + n) for c, s, n in zip(common[0], target[0], common[1]))
        out[dst] = read(i)[src]
        filled += _covered(common)
    # Saved blocks never overlap each other (one writer per distinct shard), so the
    # covered element counts add up to the target's size exactly when nothing is missing.
    if filled != _covered(target):
        raise CheckpointError(f"{name}: the saved blocks cover {filled} of the "
                              f"{_covered(target)} elements of block start={list(target[0])} "
                              f"size={list(target[1])}; a client's shard file is missing from "
                              "the checkpoint (it was written by an incomplete job).")
    return out


def assign_blocks(var, arrays: Dict[Block, np.ndarray]) -> None:
    """Assigns `var` from host arrays, one per local target block (see `target_blocks`)."""
    mesh, spec = layout_of(var)
    if mesh is None:
        ((_, block),) = target_blocks(var)
        var.assign(arrays[block])
        return
    components = []
    for device, block in target_blocks(var):
        with tf.device(device):
            components.append(tf.constant(arrays[block], dtype=var.dtype))
    var.assign(dtensor.pack(components, dtensor.Layout(
        [m or dtensor.UNSHARDED for m in spec], mesh)))
