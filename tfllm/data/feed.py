"""The device feed: the one owner of how token rows become device batches.

Which mesh axis carries a batch's rows is the rules table's answer
(`tfllm.parallel.rules.token_batch_spec`); everything after that is decided here and
nowhere else:

* which rows of each micro-batch this client reads (`local_rows`: the rows its devices
  hold, so that no client reads data it would throw away);
* how numpy arrays become (sharded) device tensors: a global batch (`to_device`), this
  client's rows only (`from_local`), any array by its logical axes (`place`: the
  generator's prompts, the step's loss limit);
* the streams of a run (`DeviceFeed`): training batches by step, validation batches,
  the first batch read ahead so that empty data fails before a run writes anything, and
  the iterator's position saved and restored as bytes for the checkpoint.

The train step, evaluation and generation only compute on what the feed gives them.
"""

from __future__ import annotations

import math
import os
import re
from typing import Dict, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfllm.confined import inside
from tfllm.files import open_for_writing, temporary_folder
from tfllm.data.errors import DataError
from tfllm.data.synthetic import SyntheticTokens
from tfllm.parallel import rules as rules_lib

#: the logical axes of a batch's rows and of its tokens
BATCH_AXES = ("activation_batch",)
TOKEN_AXES = ("activation_batch", None)


# ---- placement -------------------------------------------------------------------------
def batch_spec(parallel, shape: Sequence[int]) -> Optional[rules_lib.Spec]:
    """The layout of token rows (M, T+1, ...) on `parallel`'s mesh (None without one):
    rows over the batch's mesh axis, the rest whole (`rules.token_batch_spec`)."""
    if parallel is None:
        return None
    return rules_lib.token_batch_spec(shape, parallel.rules, parallel.shape)


def place(parallel, array, logical_axes: Optional[Sequence[Optional[str]]] = None,
          name: str = "input"):
    """A numpy array as a tensor, laid out on the mesh by its logical axes (default: token
    rows, `batch_spec`); a plain tensor without a mesh.

    Args:
      parallel: the `tfllm.parallel.Parallel`, or None.
      array: an array of any shape (a scalar with `logical_axes=()`).
      logical_axes: one logical name (or None) per dimension.
      name: what the array is, for the error when it cannot be laid out.
    """
    array = np.asarray(array)
    if parallel is None:
        return tf.constant(array)
    spec = (batch_spec(parallel, array.shape) if logical_axes is None
            else parallel.spec(name, array.shape, logical_axes))
    return _put(parallel, array, spec)


def _put(parallel, array: np.ndarray, spec):
    return tf.constant(array) if parallel is None else parallel.shard_array(array, spec)


def to_device(parallel, tokens: np.ndarray, segment_ids: Optional[np.ndarray] = None,
              loss_mask: Optional[np.ndarray] = None, reference: Optional[np.ndarray] = None):
    """A global (A, M, T+1) token array as a step's input: a tuple of A micro-batches
    (M, T+1), each sharded over the batch axis on a mesh. With `segment_ids` (same shape)
    each micro-batch is a (tokens, segment_ids) pair; with `loss_mask` as well (chat
    data: 1 where the token is a trained target) a (tokens, segment_ids, loss_mask)
    triple, every part laid out as the tokens; with `reference` (A, M) float32 as well
    (DPO's stored reference log-probability of each row, dpo.precompute_reference) a
    quadruple whose fourth part (M,) lies as the rows.

    Separate tensors, not one (A, M, T+1) DTensor: DTensor loses the layout of the
    micro-batch dimension when slicing out one micro-batch with a shrinking index.
    """
    parts = [p for p in (tokens, segment_ids, loss_mask, reference) if p is not None]
    specs = [batch_spec(parallel, p.shape[1:]) for p in parts]  # one per micro-batch
    if len(parts) == 1:
        return tuple(_put(parallel, t, specs[0]) for t in tokens)
    return tuple(tuple(_put(parallel, p, spec) for p, spec in zip(micro, specs))
                 for micro in zip(*parts))


def from_local(parallel, local_tokens: np.ndarray, rows: Sequence[int], micro_batch_rows: int,
               local_segments: Optional[np.ndarray] = None,
               local_loss_mask: Optional[np.ndarray] = None,
               local_reference: Optional[np.ndarray] = None):
    """Like `to_device`, from only this client's rows of each micro-batch.

    Args:
      parallel: the `tfllm.parallel.Parallel`, or None (then `rows` are all rows).
      local_tokens: (A, len(rows), T+1): the rows `rows` of every micro-batch.
      rows: the global row indices (within a micro-batch) this client holds.
      micro_batch_rows: M, the global micro-batch size.
      local_segments: segment ids of the same shape, or None.
      local_loss_mask: the loss mask of the same shape (chat data), or None.
      local_reference: (A, len(rows)) float32, DPO's stored reference log-probability of
        each row (dpo.precompute_reference), or None.
    """
    if parallel is None:
        return to_device(None, local_tokens, local_segments, local_loss_mask,
                         local_reference)
    position = {r: i for i, r in enumerate(rows)}

    def put(block_source):
        shape = (micro_batch_rows,) + tuple(block_source.shape[1:])  # (M, ...)
        spec = batch_spec(parallel, shape)

        def block(start, size):
            picked = [position[r] for r in range(start[0], start[0] + size[0])]
            rest = tuple(slice(b, b + n) for b, n in zip(start[1:], size[1:]))
            return tf.constant(block_source[picked][(slice(None),) + rest])
        return parallel.make_sharded(spec, shape, block)
    parts = [p for p in (local_tokens, local_segments, local_loss_mask, local_reference)
             if p is not None]
    if len(parts) == 1:
        return tuple(put(t) for t in local_tokens)
    return tuple(tuple(put(p) for p in micro) for micro in zip(*parts))


def local_rows(parallel, micro_batch_rows: int, row_length: int,
               rows_axis: Optional[str]) -> list:
    """The rows of each (M, T+1) micro-batch that this client's devices hold (all of them
    without a mesh), the rows split over `rows_axis` (`rules.BatchLayout.rows_axis`: what
    `batch_spec` resolves) and the rest whole."""
    if parallel is None:
        return list(range(micro_batch_rows))
    shape = (micro_batch_rows, row_length)
    rows = set()
    for _, start, size in parallel.local_blocks(shape, (rows_axis, None)):
        rows.update(range(start[0], start[0] + size[0]))
    return sorted(rows)


def batch_multiple(parallel) -> int:
    """The number of rows a batch must be a multiple of on this mesh (1 without one).

    The rules table shards "activation_batch" over one mesh axis (data if it has size
    > 1, else fsdp, by default); resolving the spec of a dimension every axis divides
    tells which one.
    """
    if parallel is None:
        return 1
    size = math.prod(parallel.shape.values())
    (axis,) = parallel.spec("generate batch", (size,), BATCH_AXES)
    return parallel.shape[axis] if axis else 1


# ---- the streams of a run --------------------------------------------------------------
class DeviceFeed:
    """A run's device batches: training by step, validation from the start, and the
    training iterator's position as bytes.

    Args:
      data: the validated config's `DataConfig` (source, sequence_length, seed, ...).
      train: its `TrainConfig` (global_batch_size, grad_accum_steps, eval_steps, loss_on).
      vocab_size: `model.vocab_size` (data.source=synthetic draws token ids below it).
      parallel: the run's `tfllm.parallel.Parallel`.
      tokenizer: the run's tokenizer (None for data.source=synthetic, or without data).
      with_data: open data streams at all (False: placement only, e.g. export).
      train_iterator: open the training stream and read its first batch now, so that
        empty or too little data fails before the run writes anything into its workdir.
    """

    def __init__(self, data, train, vocab_size: int, parallel, tokenizer=None,
                 with_data: bool = True, train_iterator: bool = True):
        self.data, self.train, self.vocab_size = data, train, vocab_size
        self.parallel, self.tokenizer = parallel, tokenizer
        t, d = train, data
        # The batch's own error first (naming train.global_batch_size or
        # data.sequence_length), before the generic sharding error could fire.
        #: rows per example: a preference pair (DPO) is two rows side by side, chosen
        #: and rejected (`tfllm.data.preference`); train.global_batch_size counts pairs
        self.rows_per_example = 2 if d.format == "preference" else 1
        if self.rows_per_example == 2:
            # Pairs, not rows, must divide over the batch's mesh axis: every device then
            # holds whole pairs (an even block of rows), never one half of a pair.
            try:
                rules_lib.batch_layout(t.global_batch_size, t.grad_accum_steps,
                                       d.sequence_length, parallel.rules, parallel.shape)
            except ValueError as e:  # MeshError: the same line, for pairs
                raise type(e)(f"{e} With data.format=preference these are preference "
                              "pairs (two sequences each), and a device holds whole "
                              "pairs.") from None
        layout = rules_lib.batch_layout(t.global_batch_size * self.rows_per_example,
                                        t.grad_accum_steps, d.sequence_length,
                                        parallel.rules, parallel.shape)
        self.micro_batch_rows = layout.micro_batch_rows
        self.row_length = d.sequence_length + 1
        #: the mesh axis of the rows, and of the model's sequence (None: not split)
        self.batch_axis, self.sequence_axis = layout.rows_axis, layout.sequence_axis
        #: the rows of each micro-batch this client reads
        self.rows = local_rows(parallel, self.micro_batch_rows, self.row_length,
                               self.batch_axis)
        self._synthetic = None
        self._train = None
        self._peeked = None
        self._validation = None  # the validation Batches, once an evaluation built it
        #: DPO's stored reference log-probabilities by split ("train", "validation"): (n,
        #: 2) float32, pair i's chosen and rejected (dpo.precompute_reference); a split
        #: here gives its micro-batches a fourth part, each row's value
        self.references: Dict[str, np.ndarray] = {}
        if with_data:
            if d.source == "synthetic":
                self._synthetic = SyntheticTokens(vocab_size, self.row_length, d.seed)
            elif train_iterator:
                self._train = self._batches("train", t.grad_accum_steps)
                self._peeked = next(self._train)

    def idle_batch_axes(self):
        """Token-splitting mesh axes (size > 1) that neither the batch's rows nor its
        sequence use: their devices repeat the same activations (custom rules only)."""
        p = self.parallel
        return sorted(a for a in p.batch_mesh_axes if p.shape.get(a, 1) > 1
                      and a not in (self.batch_axis, self.sequence_axis))

    def _batches(self, split: str, micro_batches: int, max_batches=None,
                 in_order: bool = False):
        from tfllm.data.pipeline import Batches  # tf.data only for text sources
        return Batches(self.data, self.tokenizer, split=split, rows=self.rows,
                       micro_batches=micro_batches, micro_batch_rows=self.micro_batch_rows,
                       max_batches=max_batches, loss_on=self.train.loss_on,
                       vocab_size=self.vocab_size, in_order=in_order)

    def pair_batches(self, split: str):
        """Every preference pair of `split` once, in order, in this run's layout
        (`tfllm.data.pipeline.Batches`, `in_order`): for DPO's reference pass. Its
        `all_pairs` are the split's pairs, the n-th batch's micro-batch a rows 2p, 2p + 1
        pair a * P + p + n * A * P (A micro-batches of P pairs; beyond the last: padding).
        """
        if split == "train":
            return self._batches("train", self.train.grad_accum_steps, in_order=True)
        return self._batches("validation", 1)

    def device_batch(self, batch: dict, split: Optional[str] = "train"):
        """A `Batches` batch of this client's rows as the step's micro-batches, each row's
        stored reference log-probability added when `split` has them (`references`)."""
        reference = None
        if split in self.references:  # each row's stored reference log-probability
            table = self.references[split]  # (n, 2)
            index = batch["pair_index"]  # (A, R), -1: padding
            half = np.asarray(self.rows) % 2  # 0: chosen, 1: rejected
            reference = np.where(index >= 0, table[np.maximum(index, 0), half],
                                 0.0).astype(np.float32)  # (A, R)
        return from_local(self.parallel, batch["tokens"], self.rows, self.micro_batch_rows,
                          batch.get("segment_ids"), batch.get("loss_mask"), reference)

    def train_batch(self, step: int):
        """The device micro-batches of training step `step` (0-based).

        Synthetic batches are indexed by step; text sources are read in order.
        """
        if self._synthetic is not None:
            t = self.train
            return to_device(self.parallel, self._synthetic.batch(
                step, t.global_batch_size, t.grad_accum_steps))
        if self._peeked is not None:
            batch, self._peeked = self._peeked, None
            return self.device_batch(batch)
        return self.device_batch(next(self._train))

    def eval_batches(self):
        """Device batches of the validation data, from its start (one micro-batch each)."""
        if self._synthetic is not None:
            # Steps far beyond any training run: held-out synthetic sequences.
            for i in range(10**9, 10**9 + 10**6):
                yield to_device(self.parallel, self._synthetic.batch(i, self.micro_batch_rows, 1))
            return
        # Built once, rewound at each evaluation: a text pipeline's tokenizer maps and a
        # chat split's rendered samples are the same every time.
        if self._validation is None:
            self._validation = self._batches("validation", 1, max_batches=self.train.eval_steps)
        else:
            self._validation.rewind()
        for batch in self._validation:
            yield self.device_batch(batch, "validation")

    # ---- the iterator's position, for checkpoints ----------------------------------------
    def state_files(self) -> Dict[str, bytes]:
        """This client's training-iterator position as {file name: bytes}."""
        if self._train is None:
            return {}
        # TensorFlow writes (and reads) an iterator's state only as a tf.train.Checkpoint
        # under a path prefix, and those files are what a checkpoint holds: their bytes
        # pass through a temporary folder.
        with temporary_folder("tfllm-iterator-") as tmp:
            self._train.save_state(os.path.join(tmp, "iterator"))
            return {name: open(os.path.join(tmp, name), "rb").read()
                    for name in sorted(os.listdir(tmp))}

    def restore_state(self, files: Dict[str, bytes]) -> None:
        """Restores the training iterator from `state_files` output (the checkpointer
        hands it this client's files: `Checkpointer.restore_latest(client_files=...)`)."""
        if self._train is None:
            return
        if not files:
            raise DataError(
                "the checkpoint holds no data-iterator state for this client: it was saved "
                "with another number of clients (each client saves the position of its own "
                "rows). Resume with the same number of clients, or start a new --workdir.")
        with temporary_folder("tfllm-iterator-") as tmp:
            for name, data in files.items():
                with open_for_writing(tmp, state_file(tmp, name), "wb") as f:
                    f.write(data)
            self._train.restore_state(os.path.join(tmp, "iterator"))
        self._peeked = None  # the restored position replaces the peeked first batch


# The names `state_files` gives: "iterator" + the suffixes tf.train.Checkpoint and
# Batches.save_state write (.json, .index, .data-00000-of-00001).
_STATE_FILE = re.compile(r"^iterator\.[A-Za-z0-9_.-]+$")


def state_file(tmp: str, name) -> str:
    """Where a checkpoint's data-iterator file `name` is written for restoring: a plain
    file name of the form `state_files` gives, inside `tmp` (the names come from the
    checkpoint's manifest, which whoever made the checkpoint controls)."""
    what = "the checkpoint's data-iterator state"
    fix = ("the checkpoint was written by a buggy or malicious program: do not resume "
           "from it")
    if not (isinstance(name, str) and _STATE_FILE.match(name)):
        raise DataError(f"{what}: {name!r} is not a file name tfllm writes "
                        f"(iterator.json, iterator.index, iterator.data-...); {fix}.")
    return inside(tmp, name, what, DataError, flat=True, fix=fix)
