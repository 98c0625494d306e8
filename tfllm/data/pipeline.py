"""Token batches for training and evaluation: tokenize, pack, shard per row, checkpoint.

Every row r of the global batch (A micro-batches of M rows: r = a * M + m) is its own
deterministic stream: it reads only document shard r of A * M, shuffles it with seed
(data.seed, r), tokenizes, appends the end-of-document id and packs the tokens into
rows of sequence_length + 1. A client that holds rows R of each micro-batch builds
only the streams {a * M + m : m in R} and zips them, so the rows a client gets do not
depend on how many clients there are: same seed, same global batches.

Each batch is a dict of int32 numpy arrays of shape (A, len(R), sequence_length + 1):
  tokens:      token ids; a document's tokens are followed by the end-of-document id.
  segment_ids: 1, 2, 3, ... numbering the documents within a row (a document cut at a
               row boundary continues as segment 1 of the stream's next row); 0 marks
               padding (only in validation). They are returned whatever
               data.packing_mask says; the model decides whether to mask by them.

With data.format messages or prompt_completion, whole samples are packed per row
(`tfllm.data.packing`, no sample is cut across rows) and batches carry a third array,
  loss_mask:   1 where the token is a trained target (train.loss_on); 0 on each
               sample's first token and on padding.
With data.format preference (DPO) rows 2p and 2p + 1 of each micro-batch are one pair's
chosen and rejected sequences, one per row, padded (`tfllm.data.preference`); the loss
mask marks their completions, and a fourth array,
  pair_index:  (A, len(R)) the place of each row's pair in its split (-1: padding), which
               names its stored reference log-probabilities (dpo.precompute_reference).

Training streams repeat forever and reshuffle each epoch (deterministically: the order
depends only on the seed and the epoch). Validation streams are unshuffled and read
once; a stream that runs out yields padding rows (segment 0) until every stream of this
client is done, or, with `max_batches`, until exactly that many batches (use it with
several clients, so that all of them take the same number of steps).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Optional

import numpy as np
import tensorflow as tf

from tfllm import files
from tfllm.data.errors import DataError
from tfllm.data.packing import PackedStream
from tfllm.data.preference import PairStream, pair_rows
from tfllm.data.samples import prepare_samples
from tfllm.data.sources import documents, strip_continued
from tfllm.data.synthetic import SyntheticTokens


def stream_seed(seed: int, row: int) -> int:
    """The shuffle seed of row stream `row`: a pure function of (data.seed, row)."""
    return int(np.random.SeedSequence([seed % 2 ** 32, row]).generate_state(1)[0])


def pack(token_docs: tf.data.Dataset, length: int, pad: bool) -> tf.data.Dataset:
    """Packs 1-D token tensors (one per document, EOD included) into rows of `length`.

    Args:
      token_docs: dataset of 1-D int32 tensors.
      length: tokens per row (sequence_length + 1).
      pad: pad the last, partial row with token 0 / segment 0 instead of dropping it.

    Returns:
      dataset of (tokens, segment_ids), each int32 of shape (length,).
    """
    # A flag marks each document's first token; a row's segment ids are the running
    # count of flags, plus 1 when the row starts in the middle of a document.
    flagged = token_docs.map(lambda ids: (ids, tf.one_hot(0, tf.shape(ids)[0],
                                                         dtype=tf.int32)))
    rows = flagged.rebatch(length, drop_remainder=not pad)

    def segments(ids, flags):
        seg = tf.cumsum(flags) + (1 - flags[0])
        if pad:
            n = length - tf.shape(ids)[0]
            ids, seg = tf.pad(ids, [[0, n]]), tf.pad(seg, [[0, n]])
            ids.set_shape([length]), seg.set_shape([length])
        return ids, seg
    return rows.map(segments)


class Batches:
    """Iterator over token batches of this client's rows, with exact save/restore.

    Args:
      data: the config's `DataConfig` (source, format, files, sequence_length, seed, ...).
      tokenizer: a tfllm.data.tokenizer.Tokenizer (unused for data.source=synthetic).
      split: "train" (shuffled, repeated) or "validation" (in order, read once).
      rows: this client's row indices within a micro-batch, the same for every
        micro-batch; None means all rows.
      micro_batches: A, micro-batches per batch (a run's train.grad_accum_steps).
      micro_batch_rows: M, rows per micro-batch (a run's train.global_batch_size // A).
      max_batches: stop after this many batches (validation: pad up to it).
      loss_on: which targets chat data trains on (train.loss_on; data.format messages
        and prompt_completion only).
      vocab_size: model.vocab_size, which data.source=synthetic draws tokens below.
      in_order: preference pairs of the training split read as validation's are: each
        stream's pairs in order, once, then padding (DPO's reference pass over every
        training pair, `tfllm.train.reference`).
    """

    def __init__(self, data, tokenizer=None, split: str = "train",
                 rows: Optional[Iterable[int]] = None, *, micro_batches: int,
                 micro_batch_rows: int, max_batches: Optional[int] = None,
                 loss_on: str = "all", vocab_size: Optional[int] = None,
                 in_order: bool = False):
        self.data, self.tokenizer, self.split = data, tokenizer, split
        #: read once, in order (validation, or a reference pass over training pairs)
        self.once = split != "train" or in_order
        self.loss_on = loss_on
        self.micro_batches, self.micro_batch_rows = micro_batches, micro_batch_rows
        self.rows = list(range(self.micro_batch_rows)) if rows is None else list(rows)
        if not self.rows or any(not 0 <= r < self.micro_batch_rows for r in self.rows):
            raise DataError(f"rows {self.rows} must be a non-empty subset of "
                            f"range({self.micro_batch_rows}) (the rows of a micro-batch).")
        self.length = data.sequence_length + 1
        self.max_batches = max_batches
        self._count = 0
        if data.source == "synthetic":
            if vocab_size is None:
                raise DataError("data.source=synthetic draws token ids below the model's "
                                "vocabulary: give Batches vocab_size=model.vocab_size.")
            seed = data.seed + (0 if split == "train" else 1)
            self._synthetic = SyntheticTokens(vocab_size, self.length, seed)
            return
        if tokenizer is None:
            raise DataError(f"data.source={data.source} needs a tokenizer; see "
                            "tfllm.data.tokenizer.load_tokenizer.")
        self._synthetic = None
        self._packed = None
        self._pairs = None
        if data.format == "preference":
            self._pairs = self._pair_streams()
            return
        if data.format != "text":
            self._packed = self._packed_streams()
            return
        self.dataset = self._build()
        self._iterator = iter(self.dataset)

    @property
    def num_streams(self) -> int:
        """Rows of the global batch: every one is an independent stream."""
        return self.micro_batches * self.micro_batch_rows

    @property
    def num_rows(self) -> int:
        """Rows of the global batch this client reads (A x len(rows)): its streams."""
        return self.micro_batches * len(self.rows)

    def _stream(self, row, seed) -> tf.data.Dataset:
        """Row stream `row` (a Python int, or an int64 scalar tensor), shuffled with `seed`
        (its `stream_seed`) when training; built inside a tf.data function (`_rows`)."""
        assert tf.inside_function(), "row streams are built in a traced function"
        data, train = self.data, self.split == "train"
        docs = documents(data, self.split, self.num_streams, row)
        if train:
            # shuffle_buffer counts documents over the whole global batch, so memory
            # (and the iterator checkpoint) does not grow with the number of rows.
            buffer = max(1, data.shuffle_buffer // self.num_streams)
            # The order depends on (data.seed, row) only, not on TensorFlow's global seed
            # (which another library may have set): this trace's graph seed is cleared.
            graph = tf.compat.v1.get_default_graph()
            outer, graph.seed = graph.seed, None
            try:
                docs = docs.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
            finally:
                graph.seed = outer
            docs = docs.repeat()
        eod = tf.constant([self.tokenizer.eod_id], tf.int32)
        encode = self.tokenizer.traced_encode()
        def tokenize(doc):
            text, continued = strip_continued(doc)
            # A piece of a longer text document continues in the next piece: no EOD.
            return tf.concat([encode(text), eod[:1 - tf.cast(continued, tf.int32)]], 0)
        token_docs = docs.map(tokenize, num_parallel_calls=tf.data.AUTOTUNE,
                              deterministic=True)
        packed = pack(token_docs, self.length, pad=not train)
        if not train:
            padding = tf.zeros([self.length], tf.int32)
            packed = packed.concatenate(
                tf.data.Dataset.from_tensors((padding, padding)).repeat())
        return packed

    def _packed_streams(self):
        """Chat or prompt/completion samples (data.format), packed whole per row stream."""
        samples = prepare_samples(self.data, self.tokenizer, self.split, self.loss_on)
        train = self.split == "train"
        streams = []
        for a in range(self.micro_batches):
            for m in self.rows:
                row = a * self.micro_batch_rows + m
                mine = samples[row::self.num_streams]
                if train and not mine:
                    raise DataError(
                        f"data.paths: {len(samples)} training samples, fewer than the "
                        f"{self.num_streams} rows of a global batch (each row reads its own "
                        "share of the samples); add samples or lower "
                        "train.global_batch_size.")
                seed = stream_seed(self.data.seed, row) if train else None
                streams.append(PackedStream(mine, self.length, seed))
        return streams

    def _pair_streams(self):
        """Preference pairs (DPO): rows 2p and 2p + 1 of a micro-batch are pair stream
        p's chosen and rejected; stream (a, p) reads pairs a * P + p, a * P + p + A * P,
        ... of the split (P pairs per micro-batch)."""
        pairs_per_micro = self.micro_batch_rows // 2
        if self.micro_batch_rows % 2 or any(r ^ 1 not in self.rows for r in self.rows):
            raise DataError(f"preference rows {self.rows} of {self.micro_batch_rows} split a "
                            "pair (rows 2p and 2p + 1 are one pair's chosen and rejected); "
                            "give a client whole pairs.")
        pairs = prepare_samples(self.data, self.tokenizer, self.split, self.loss_on)
        #: every pair of the split, in order (what stored reference log-probs are for)
        self.all_pairs = pairs
        streams = self.micro_batches * pairs_per_micro
        train = self.split == "train"
        if train and len(pairs) < streams:
            raise DataError(f"data.paths: {len(pairs)} training preference pairs, fewer than "
                            f"the {streams} pairs of a global batch (each reads its own share "
                            "of the pairs); add pairs or lower train.global_batch_size.")
        out = {}
        for a in range(self.micro_batches):
            for p in sorted({r // 2 for r in self.rows}):
                stream = a * pairs_per_micro + p
                seed = stream_seed(self.data.seed, stream) if not self.once else None
                out[a, p] = PairStream(pairs[stream::streams], seed)
        return out

    def _next_pairs(self) -> Dict[str, np.ndarray]:
        if (self.once and self.max_batches is None
                and all(s.exhausted() for s in self._pairs.values())):
            raise StopIteration
        drawn = {}
        for key, stream in self._pairs.items():
            pair = next(stream)
            drawn[key] = (pair_rows(pair, self.length), -1 if pair is None else pair.index)
        keys = [(a, r // 2) for a in range(self.micro_batches) for r in self.rows]
        rows = [drawn[key][0][r % 2] for key, r in zip(keys, self.rows * self.micro_batches)]
        shape = (self.micro_batches, len(self.rows), self.length)
        batch = {name: np.stack([r[i] for r in rows]).reshape(shape)  # (A, R, T+1)
                 for i, name in enumerate(("tokens", "segment_ids", "loss_mask"))}
        batch["pair_index"] = np.asarray([drawn[key][1] for key in keys],
                                         np.int32).reshape(shape[:2])  # (A, R)
        return batch

    def _next_packed(self) -> Dict[str, np.ndarray]:
        if (self.split != "train" and self.max_batches is None
                and all(s.exhausted() for s in self._packed)):
            raise StopIteration
        rows = [next(s) for s in self._packed]
        shape = (self.micro_batches, len(self.rows), self.length)
        return {name: np.stack([r[i] for r in rows]).reshape(shape)  # (A, R, T+1)
                for i, name in enumerate(("tokens", "segment_ids", "loss_mask"))}

    def _rows(self, rows, per_row: bool = False) -> tf.data.Dataset:
        """Every stream of `rows` side by side: (positions, tokens, segment_ids) of shapes
        (n,), (n, length), (n, length), where positions are 0..n-1 while every stream
        yields.

        The streams are one template traced once, applied to a row index (a tensor) by an
        interleave that takes one element from each stream in turn. A pipeline per row
        cost a trace per row (a client with 128 rows took 73 s to its first batch,
        benchmarks/data_pipeline.py). TFDS names each row's shard by a Python index
        (`tfds.even_splits`), so its streams are built one by one and zipped (`per_row`:
        also for tests).
        """
        n = len(rows)
        seeds = [stream_seed(self.data.seed, r) for r in rows]
        if per_row or self.data.source == "tfds":
            streams = tuple(
                tf.data.Dataset.range(1).interleave(tf.autograph.experimental.do_not_convert(
                    lambda _, r=r, s=s: self._stream(r, s)))
                for r, s in zip(rows, seeds))

            def stack(*pairs):
                return (tf.range(n, dtype=tf.int64), tf.stack([p[0] for p in pairs]),
                        tf.stack([p[1] for p in pairs]))
            return tf.data.Dataset.zip(streams).map(stack)
        row_of = tf.constant(rows, tf.int64)
        seed_of = tf.constant(seeds, tf.int64)

        @tf.autograph.experimental.do_not_convert
        def stream(position):
            return self._stream(tf.gather(row_of, position), tf.gather(seed_of, position)
                                ).map(lambda tokens, segments: (position, tokens, segments))
        # An empty stream would drop out of the turn and shift the rows after it: the
        # positions name each element's stream, checked in __next__.
        return tf.data.Dataset.range(n).interleave(
            stream, cycle_length=n, block_length=1
        ).batch(n, drop_remainder=True)

    def _build(self, per_row: bool = False) -> tf.data.Dataset:
        rows = [a * self.micro_batch_rows + m
                for a in range(self.micro_batches) for m in self.rows]
        shape = [self.micro_batches, len(self.rows), self.length]

        def stack(positions, tokens, segments):
            return {"positions": positions, "tokens": tf.reshape(tokens, shape),  # (A, R, T+1)
                    "segment_ids": tf.reshape(segments, shape)}
        ds = self._rows(rows, per_row).map(stack)
        if self.split != "train":
            if self.max_batches is None:  # stop when every stream is padding
                ds = ds.take_while(lambda b: tf.reduce_any(b["segment_ids"] > 0))
        if self.max_batches is not None:
            ds = ds.take(self.max_batches)
        options = tf.data.Options()
        options.deterministic = True
        # Tokenizer ops hold their model in a resource; it is rebuilt, not saved.
        options.experimental_external_state_policy = (
            tf.data.experimental.ExternalStatePolicy.IGNORE)
        return ds.prefetch(2).with_options(options)

    def rewind(self) -> None:
        """Back to the first batch of a validation split without building its pipeline
        again: validation rows are read in order, unshuffled, so every evaluation reads
        the same batches (`tfllm.data.feed.DeviceFeed.eval_batches` keeps one `Batches`)."""
        if self.split == "train":
            raise DataError("a training Batches shuffles and repeats: its position is "
                            "restored from a checkpoint (restore_state), not rewound.")
        self._count = 0
        if self._synthetic is not None:
            return
        if self._packed is not None or self._pairs is not None:
            for stream in self._packed or self._pairs.values():
                stream.position = 0
            return
        self._iterator = iter(self.dataset)

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        if self.max_batches is not None and self._count >= self.max_batches:
            raise StopIteration
        if self._synthetic is not None:
            tokens = self._synthetic.batch(self._count, self.num_streams,
                                           self.micro_batches)[:, self.rows]
            batch = {"tokens": tokens, "segment_ids": np.ones_like(tokens)}
        elif self._pairs is not None:
            batch = self._next_pairs()
        elif self._packed is not None:
            batch = self._next_packed()
        else:
            try:
                batch = {k: v.numpy() for k, v in next(self._iterator).items()}
                if not np.array_equal(batch.pop("positions"), np.arange(self.num_rows)):
                    # a stream ran out (validation streams end in endless padding: only
                    # an empty training stream can)
                    raise StopIteration
            except StopIteration:
                if self.split == "train":
                    raise DataError(
                        f"data.source={self.data.source}: a row stream has no "
                        f"documents; every one of the {self.num_streams} rows of a global "
                        "batch reads its own shard, so the training data needs at least "
                        "that many documents. Add data or lower train.global_batch_size."
                    ) from None
                raise
        self._count += 1
        return batch

    def save_state(self, path_prefix: str) -> str:
        """Writes this client's iterator position under `path_prefix` (in a folder tfllm
        made: `tfllm.data.feed` gives a temporary one); returns the checkpoint path."""
        folder = os.path.dirname(os.path.abspath(path_prefix))
        files.write_atomically(folder, path_prefix + ".json",
                               json.dumps({"count": self._count, "rows": self.rows}))
        if self._synthetic is not None or self._packed is not None or self._pairs is not None:
            return path_prefix + ".json"
        return tf.train.Checkpoint(iterator=self._iterator).write(path_prefix)

    def restore_state(self, path_prefix: str) -> None:
        """Restores a position written by save_state (same config, split and rows)."""
        try:
            with open(path_prefix + ".json") as f:
                state = json.load(f)
        except OSError as e:
            raise DataError(f"no data-iterator state at {path_prefix}.json ({e}); resume "
                            "from a checkpoint that has one or start a new run.") from None
        if state["rows"] != self.rows:
            raise DataError(f"{path_prefix}: saved for rows {state['rows']}, not "
                            f"{self.rows}; restore with the same number of clients.")
        self._count = state["count"]
        if self._packed is not None or self._pairs is not None:
            # a packed or pair stream's n-th row is a pure function of n
            for stream in self._packed or self._pairs.values():
                stream.position = self._count
        elif self._synthetic is None:
            try:
                tf.train.Checkpoint(iterator=self._iterator).read(path_prefix
                                                                   ).assert_consumed()
            except tf.errors.OpError:
                raise DataError(
                    "the checkpoint's data-iterator position was saved by a tf.data "
                    "pipeline of another shape (tfllm before 2026-11-27 built one pipeline "
                    "per row; or the data settings changed); resume with the tfllm and "
                    "settings that saved it, or start a new --workdir.") from None
