"""Documents of each source as tf.data datasets of scalar tf.string, one per document.

What a document is, per source:
  corpus:   one standard-library file (see tfllm.data.corpus).
  text:     one file of data.paths; a file may hold several documents separated by
            the GPT-2 convention `<|endoftext|>`. Files must be non-empty UTF-8: this is
            checked up front in Python, so a bad byte is an error naming the file and
            its offset rather than a tf error mid-training.
  tfrecord: one tf.train.Example; its bytes feature data.text_key is the text.
  tfds:     one example of the dataset; its feature data.text_key is the text.
  hf:       one row of a Hugging Face dataset; its column data.text_key is the text
            (`tfllm.data.hf`: files of data.paths, or data.hf_dataset).
  (data.format messages / prompt_completion: one line of the JSONL files of data.paths,
  or one row of data.source=hf, held out by a hash of the line (a row: of its JSON);
  `tfllm.data.samples` renders and tokenizes them.)

Without separate validation data (data.eval_paths, for tfds data.tfds_eval_split, for
hf data.eval_paths or data.hf_eval_split), a document is held out when a hash of its text falls below
data.validation_fraction: the split never overlaps and does not depend on order. With
data.validation_fraction=0 as well there is no validation data (`has_validation`): the
run trains on everything and does not evaluate, as Keras' `validation_split=0`.

`documents(data, split, num_shards, index)` returns shard `index` of `num_shards`:
the pipeline gives every row of the global batch its own shard.
"""

from __future__ import annotations

import codecs
import difflib
import glob
import os
from typing import Iterator, List, Optional, Tuple

import tensorflow as tf

from tfllm.confined import open_regular
from tfllm.data import chat, hf, preference
from tfllm.data.errors import DataError

SEPARATOR = "<|endoftext|>"
#: text documents longer than this many lines are cut into pieces of this many lines, so
#: that even one large file spreads over every row stream of the batch
PIECE_LINES = 64
#: ends every piece but a document's last: the pipeline adds no end-of-document after it
CONTINUED = "\ue000"
_EMPTY = "\ue001"
HASH_BUCKETS = 1 << 20
# Files already checked in this process, by (path, size, mtime): every row stream asks
# for the same files, and the check reads each file in full.
_CHECKED = set()


def _unchecked(files: List[str], what: str):
    """Yields the files not yet checked; a file counts as checked once its check passed."""
    for path in files:
        key = (what, path, os.path.getsize(path), os.stat(path).st_mtime_ns)
        if key not in _CHECKED:
            yield path
            _CHECKED.add(key)  # reached only when the caller's check did not raise


def resolve_files(patterns: List[str], key: str) -> List[str]:
    """Files matching the globs, sorted per pattern; a pattern matching nothing is an error.

    Args:
      patterns: paths or glob patterns (`~` is expanded).
      key: the config key they came from, for error messages.
    """
    if not patterns:
        raise DataError(f"{key} is empty; list the data files or glob patterns, e.g. "
                        f"--set {key}=data/*.txt.")
    files = []
    for pattern in patterns:
        found = glob.glob(os.path.expanduser(pattern), recursive=True)
        matches = sorted(p for p in found if os.path.isfile(p))  # regular files only
        if found and not matches:
            raise DataError(f"{key}: '{pattern}' matches {sorted(found)[0]}, which is no "
                            "regular file (a directory, FIFO or device); name data files.")
        if not matches:
            raise DataError(f"{key}: '{pattern}' matches no files; fix the path or glob "
                            f"(relative paths are from {os.getcwd()}).")
        files.extend(matches)
    return files


def check_text_files(files: List[str], key: str) -> None:
    """Every file is non-empty, valid UTF-8; else an error naming the file and byte offset."""
    for path in _unchecked(files, "text"):
        if os.path.getsize(path) == 0:
            raise DataError(f"{key}: {path} is empty; remove it from {key} or add text.")
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        offset = 0
        with open_regular(path, None, f"a text file of {key}", DataError) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as e:
                    # e.start counts from the decoder's pending bytes plus this block.
                    pending = len(e.object) - len(block)
                    raise DataError(
                        f"{key}: {path} is not UTF-8 at byte offset "
                        f"{offset + e.start - pending} ({e.reason}); re-encode it as UTF-8, "
                        f"e.g. iconv -f latin1 -t utf-8 {path}.") from None
                offset += len(block)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError as e:
                raise DataError(f"{key}: {path} ends inside a UTF-8 character (byte offset "
                                f"{offset - len(e.object) + e.start}); re-encode it as "
                                "UTF-8.") from None


def _parse_fn(text_key: str):
    spec = {text_key: tf.io.FixedLenFeature([], tf.string)}
    return lambda record: tf.io.parse_single_example(record, spec)[text_key]


def check_tfrecord_files(files: List[str], text_key: str, key: str) -> None:
    """The first record of each file has the bytes feature `text_key`. Reads eagerly,
    also while a pipeline's row template is traced."""
    for path in _unchecked(files, "tfrecord:" + text_key):
        with tf.init_scope():
            first = list(tf.data.TFRecordDataset(path).take(1))
        for record in first:
            example = tf.train.Example.FromString(record.numpy())
            features = example.features.feature
            if text_key not in features or not features[text_key].bytes_list.value:
                have = sorted(features)
                raise DataError(f"{key}: {path} has no bytes feature '{text_key}' (it has "
                                f"{have}); set data.text_key to the feature holding the "
                                "text.")


def _holdout(docs: tf.data.Dataset, fraction: float, keep_validation: bool):
    threshold = int(fraction * HASH_BUCKETS)

    def keep(doc):
        held = tf.strings.to_hash_bucket_fast(doc, HASH_BUCKETS) < threshold
        return held if keep_validation else tf.logical_not(held)
    return docs.filter(keep)


def _shard(ds: tf.data.Dataset, num_shards: int, index: int) -> tf.data.Dataset:
    return ds.shard(num_shards, index) if num_shards > 1 else ds


def _file_documents(data, split: str, num_shards: int, index: int) -> tf.data.Dataset:
    if data.eval_paths:  # separate validation files: nothing is held out of data.paths
        holdout = None
        patterns, key = ((data.eval_paths, "data.eval_paths") if split == "validation"
                         else (data.paths, "data.paths"))
    else:
        patterns, key = data.paths, "data.paths"
        # True: keep only the held-out docs; False: drop them; None: keep everything
        # (no validation data: `documents` refuses the validation split).
        holdout = (split == "validation") if data.validation_fraction > 0 else None
    files = resolve_files(patterns, key)
    if data.source == "text":
        check_text_files(files, key)
        docs = tf.data.Dataset.from_tensor_slices(files).map(tf.io.read_file)
        docs = docs.flat_map(lambda text: tf.data.Dataset.from_tensor_slices(
            tf.strings.split(text, SEPARATOR)))
        docs = docs.filter(lambda d: tf.strings.length(tf.strings.strip(d)) > 0)
        docs = docs.flat_map(lambda d: tf.data.Dataset.from_tensor_slices(_pieces(d)))
    else:
        check_tfrecord_files(files, data.text_key, key)
        records = tf.data.TFRecordDataset(files)
        if holdout is None:  # shard the raw records: each stream parses only its own
            return _shard(records, num_shards, index).map(_parse_fn(data.text_key))
        docs = records.map(_parse_fn(data.text_key))
    if holdout is not None:
        docs = _holdout(docs, data.validation_fraction, keep_validation=holdout)
    return _shard(docs, num_shards, index)


def _pieces(doc):
    """A document cut into pieces of PIECE_LINES lines; all but the last end in
    "\n" + CONTINUED, so joining them without the markers gives back the document."""
    ends_in_newline = tf.strings.substr(doc, -1, 1) == "\n"
    lines = tf.strings.split(tf.strings.regex_replace(doc, "\n$", ""), "\n")  # (n,)
    n = tf.size(lines)
    num = (n + PIECE_LINES - 1) // PIECE_LINES
    lengths = tf.concat([tf.fill([num - 1], PIECE_LINES), [n - (num - 1) * PIECE_LINES]], 0)
    # reduce_join over ragged rows drops empty strings: hold empty lines' places.
    lines = tf.where(lines == "", _EMPTY, lines)
    pieces = tf.strings.reduce_join(tf.RaggedTensor.from_row_lengths(lines, lengths),
                                    axis=1, separator="\n")  # (num,)
    pieces = tf.strings.regex_replace(pieces, _EMPTY, "")
    last = tf.where(ends_in_newline, "\n", "")
    marks = tf.concat([tf.fill([num - 1], "\n" + CONTINUED), [last]], 0)
    return pieces + marks


def strip_continued(text):
    """(text without a trailing CONTINUED marker, whether it had one) of a tf.string."""
    continued = tf.strings.substr(text, -1, 1, unit="UTF8_CHAR") == CONTINUED
    return tf.strings.regex_replace(text, CONTINUED + "$", ""), continued


def check_tfds_name(name: str) -> None:
    """An unknown TFDS dataset name is an error suggesting the closest known names."""
    import tensorflow_datasets as tfds

    if not name:
        raise DataError("data.source=tfds needs data.tfds_name, e.g. --set "
                        "data.tfds_name=lm1b.")
    base = name.split(":")[0].split("/")[0]
    builders = tfds.list_builders()
    if base not in builders:
        close = difflib.get_close_matches(base, builders, n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise DataError(f"data.tfds_name={name}: unknown TensorFlow Datasets name.{hint} "
                        "See tfds.list_builders() for the names.")


def has_validation(data) -> bool:
    """Whether the data settings (`config.data`) give validation data: separate
    validation data, or documents held out by data.validation_fraction > 0 (synthetic
    data always has held-out sequences). Without it a run does not evaluate."""
    if data.source == "synthetic" or data.validation_fraction > 0:
        return True
    if data.source in ("text", "tfrecord"):
        return bool(data.eval_paths)
    if data.source == "hf":
        return bool(data.eval_paths if data.paths else data.hf_eval_split)
    return data.source == "tfds" and bool(data.tfds_eval_split)


def _separate_key(data) -> Optional[str]:
    """The setting that names separate validation data for data.source."""
    if data.source == "hf":
        return "data.eval_paths" if data.paths else "data.hf_eval_split"
    return {"text": "data.eval_paths", "tfrecord": "data.eval_paths",
            "tfds": "data.tfds_eval_split"}.get(data.source)


def no_validation_reason(data) -> str:
    """The settings that give no validation data, as the user would set them."""
    separate = {"text": "no data.eval_paths", "tfrecord": "no data.eval_paths",
                "tfds": "an empty data.tfds_eval_split"}.get(data.source)
    if data.source == "hf":
        separate = "no data.eval_paths" if data.paths else "an empty data.hf_eval_split"
    return "data.validation_fraction=0" + (f" and {separate}" if separate else "")


def validation_hint(data) -> str:
    """Where the validation documents come from and how to get some, for the error of a
    validation split without text."""
    off = "or set data.validation_fraction=0 (and no separate validation data) to train "\
          "without evaluation"
    if data.source in ("text", "tfrecord") and data.eval_paths:
        return (f"data.eval_paths={data.eval_paths} give no documents: name files with "
                f"text, {off}.")
    if data.source == "hf" and (data.eval_paths if data.paths else data.hf_eval_split):
        return (f"{_separate_key(data)} gives no documents: name data with text, {off}.")
    if data.source == "tfds" and data.tfds_eval_split:
        return (f"data.tfds_eval_split={data.tfds_eval_split} of {data.tfds_name} gives no "
                f"documents: name a split with text (or none, to hold out "
                f"data.validation_fraction of data.tfds_split), {off}.")
    separate = {"text": "name validation files (data.eval_paths), ",
                "tfrecord": "name validation files (data.eval_paths), ",
                "tfds": "name a validation split (data.tfds_eval_split), ",
                "hf": (f"name validation data ({_separate_key(data)}), "
                       if data.source == "hf" else ""),
                }.get(data.source, "")
    return (f"data.validation_fraction={data.validation_fraction:g} held out no document "
            "(each document is held out by a hash of its text, so few documents may give "
            f"none): raise data.validation_fraction, {separate}{off}.")


def _tfds_split(data, split: str) -> str:
    if split == "train" and data.tfds_eval_split:
        return data.tfds_split
    if split == "validation" and data.tfds_eval_split:
        return data.tfds_eval_split
    if data.validation_fraction == 0:  # no validation data: train on the whole split
        return data.tfds_split
    # No eval split: hold out the first validation_fraction percent of the train split.
    percent = max(1, round(100 * data.validation_fraction))
    return (f"{data.tfds_split}[{percent}%:]" if split == "train"
            else f"{data.tfds_split}[:{percent}%]")


def _tfds_documents(data, split: str, num_shards: int, index: int) -> tf.data.Dataset:
    import tensorflow_datasets as tfds

    check_tfds_name(data.tfds_name)
    # even_splits reads only this shard's examples, unlike Dataset.shard.
    sub = tfds.even_splits(_tfds_split(data, split), n=num_shards)[index]
    ds = tfds.load(data.tfds_name, split=sub, data_dir=os.path.expanduser(data.tfds_data_dir) or None,
                   shuffle_files=False)
    if data.text_key not in ds.element_spec:
        raise DataError(f"data.text_key={data.text_key}: {data.tfds_name} has no such "
                        f"feature (it has {sorted(ds.element_spec)}); set data.text_key.")
    return ds.map(lambda ex: ex[data.text_key])


def documents(data, split: str, num_shards: int = 1, index: int = 0) -> tf.data.Dataset:
    """Shard `index` of `num_shards` of a split's documents, in a fixed order.

    Args:
      data: the config's `DataConfig`.
      split: "train" or "validation".
      num_shards: number of disjoint shards (one per row of the global batch).
      index: which shard, in [0, num_shards).
    """
    if split not in ("train", "validation"):
        raise DataError(f"split must be 'train' or 'validation', got {split!r}.")
    if split == "validation" and not has_validation(data):
        separate = _separate_key(data)
        raise DataError(f"no validation data ({no_validation_reason(data)}); set "
                        + (f"{separate} or " if separate else "")
                        + "data.validation_fraction > 0.")
    source = data.source
    if data.format != "text":  # JSONL samples: one document per line of the split
        lines = [r.text for r in split_records(data, split)]
        docs = tf.data.Dataset.from_tensor_slices(tf.constant(lines, tf.string, [len(lines)]))
        return _shard(docs, num_shards, index)
    if source == "tfds":
        return _tfds_documents(data, split, num_shards, index)
    if source == "hf":
        return _hf_documents(data, split, num_shards, index)
    if source == "corpus":
        from tfllm.data.corpus import build_corpus

        manifest = build_corpus(data.data_dir, data.validation_fraction)
        records = tf.data.TFRecordDataset(manifest[split])
        return _shard(records, num_shards, index).map(_parse_fn("text"))
    if source in ("text", "tfrecord"):
        return _file_documents(data, split, num_shards, index)
    raise DataError(f"data.source={source} has no documents; use corpus, text, "
                    "tfrecord, tfds or hf.")


def hf_split(data, split: str) -> Tuple[hf.Split, Optional[bool]]:
    """Where a split of data.source=hf is read (`tfllm.data.hf.Split`), and which of its
    rows it keeps: True only those held out by data.validation_fraction, False all but
    them, None all (separate validation data, or none)."""
    if not data.paths and not data.hf_dataset:
        raise DataError("data.source=hf reads data.paths (parquet, JSON, CSV or arrow "
                        "files) or data.hf_dataset (a save_to_disk folder or a hub name): "
                        "set one, e.g. --set 'data.paths=[\"data/*.parquet\"]'.")
    if data.paths and (data.hf_dataset or data.hf_eval_split or data.hf_split != "train"):
        named = next(f"data.{k}={getattr(data, k)}" for k in ("hf_dataset", "hf_eval_split",
                                                              "hf_split")
                     if getattr(data, k) and (k != "hf_split" or data.hf_split != "train"))
        raise DataError(f"{named} names a dataset or its split, but data.paths names data "
                        "files: set one of them (with data.paths, data.eval_paths names the "
                        "validation files).")
    separate = bool(data.eval_paths if data.paths else data.hf_eval_split)
    holdout = None if separate or not data.validation_fraction else split == "validation"
    common = dict(streaming=data.hf_streaming, config_name=data.hf_config)
    if data.paths:
        patterns, key = ((data.eval_paths, "data.eval_paths") if separate and
                         split == "validation" else (data.paths, "data.paths"))
        return hf.Split(files=tuple(resolve_files(patterns, key)), key=key, **common), holdout
    name, key = ((data.hf_eval_split, "data.hf_eval_split") if separate and
                 split == "validation" else (data.hf_split, "data.hf_split"))
    return hf.Split(dataset=data.hf_dataset, name=name, key=key, **common), holdout


def _hf_documents(data, split: str, num_shards: int, index) -> tf.data.Dataset:
    # Sharded by row first (each stream reads only its rows of a memory-mapped set), then
    # filtered: rows without text, and by the holdout's hash of the text.
    where, holdout = hf_split(data, split)
    docs = hf.texts(where, data.text_key, num_shards, index)
    docs = docs.filter(lambda d: tf.strings.length(tf.strings.strip(d)) > 0)
    if holdout is not None:
        docs = _holdout(docs, data.validation_fraction, keep_validation=holdout)
    return docs


def split_files(data, split: str) -> List[str]:
    """The JSONL files a split reads: data.eval_paths for validation when set, else
    data.paths."""
    if data.eval_paths and split == "validation":
        return resolve_files(data.eval_paths, "data.eval_paths")
    return resolve_files(data.paths, "data.paths")


def split_key(data, split: str) -> tuple:
    """What a split's records depend on (the files' sizes and times): a cache key."""
    if data.source == "hf":
        return hf_split(data, split)[0].signature()
    return tuple((path, os.path.getsize(path), os.stat(path).st_mtime_ns)
                 for path in split_files(data, split))


def split_records(data, split: str) -> list:
    """A split's records: every line of its files (data.source=hf: every row), less
    (training) or only (validation) the lines held out by data.validation_fraction when
    there is no separate validation data."""
    parse = preference.parse_line if data.format == "preference" else chat.parse_line
    if data.source == "hf":
        where, holdout = hf_split(data, split)
        records = hf.records(where, data.format, parse)
    else:
        records = chat.read_records(split_files(data, split), data.format, parse)
        holdout = (None if data.eval_paths or not data.validation_fraction
                   else split == "validation")
    if holdout is not None:
        records = [r for r in records
                   if chat.held_out(r, data.validation_fraction) == holdout]
    return records


def iterate_documents(data, split: str) -> Iterator[str]:
    """A split's documents as Python strings (for tokenizer training and statistics).

    Args:
      data: the config's `DataConfig`.
      split: "train" or "validation".
    """
    for doc in documents(data, split).as_numpy_iterator():
        yield doc.decode("utf-8", errors="replace").removesuffix(CONTINUED)
