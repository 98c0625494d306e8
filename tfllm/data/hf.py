"""Hugging Face `datasets` as a token source (data.source=hf): texts and samples.

What a split is read from (`Split`; `tfllm.data.sources` decides which for a split):
  data.paths / data.eval_paths: parquet, JSON (.json, .jsonl), CSV or arrow files,
      `load_dataset(<type>, data_files=...)`, the type from the files' suffix;
  data.hf_dataset, a folder `save_to_disk` wrote: `load_from_disk` (a DatasetDict's
      split data.hf_split / data.hf_eval_split);
  data.hf_dataset, a hub name (`user/name`, with data.hf_config): `load_dataset` from
      the local Hugging Face cache, or downloaded where the machine can (HF_HUB_OFFLINE=1
      and HF_DATASETS_OFFLINE=1 keep it to the cache).
With data.hf_streaming the rows are read as they are used (`IterableDataset`): nothing is
converted into the arrow cache first, for sets larger than the disk or not downloaded.

data.format=text: a row's column data.text_key is one document, tokenized and packed by
the text sources' path (`tfllm.data.pipeline`). `texts` gives shard `index` of `S` of the
rows, in blocks: block j of shard i is rows j*P + i, j*P + i + S, ... below (j + 1) * P,
P = BLOCK * S. The blocks are a `tf.data.Dataset.range`, each read by a `py_function`,
so the position a checkpoint saves is a block number and the texts still buffered: a
resume reads on from the same row, exactly (a stream reopens its `IterableDataset` at
row j * P with `skip`). Streaming and random access read the same blocks, so they give
the same documents; a stream of a streamed set reads every row of the set and keeps its
own (S readers), where a memory-mapped arrow set reads only its own rows.
data.format messages / prompt_completion / preference: the columns of TRL's dataset
formats (messages and tools; prompt and completion; prompt, chosen and rejected), each
row checked and parsed exactly as a JSONL line of the same keys (`tfllm.data.chat`,
`tfllm.data.preference`), so a row gives the tokens the JSONL line gives. Arrow gives
every struct of a column the union of the keys of all rows, a missing one as null: keys
whose value is null are dropped, which gives back each row's own keys.

Reads are bounded as tfllm's own (`tfllm.confined`): `datasets` opens the files, so
before it does, every data file named must be a regular file (a FIFO or device would
block it: `tfllm.data.sources.resolve_files`), and a saved folder must hold only regular
files inside it (no link out) with its JSON records at most MAX_RECORD_BYTES. Data files
have no size bound, as the text source's have none. A hub dataset is read from the
Hugging Face cache, which `datasets` itself wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from tfllm.data.chat import MAX_LINE_BYTES
from tfllm.data.errors import DataError

#: rows of a block of one stream (a block of the set is BLOCK rows per stream)
BLOCK = 64
#: the largest JSON record (dataset_info.json, state.json, ...) a saved folder may hold
MAX_RECORD_BYTES = 16 * 2 ** 20
#: data.paths suffixes and the `datasets` builder that reads them
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv",
            ".arrow": "arrow"}
#: the columns of each data.format (TRL's dataset formats) that a row must have
COLUMNS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"),
           "preference": ("chosen", "rejected")}
#: further columns passed on when a row has them
OPTIONAL = {"messages": ("tools",), "prompt_completion": (),
            "preference": ("prompt", "tools")}
INSTALL = "pip install 'tfllm[hf-data]'"


@dataclass(frozen=True)
class Split:
    """Where one split's rows come from.

    Args:
      files: data files (data.paths or data.eval_paths, resolved), or empty.
      dataset: data.hf_dataset (a saved folder or a hub name) when no files.
      config_name: data.hf_config, the hub dataset's configuration.
      name: the split of a DatasetDict or a hub dataset (files: "train").
      key: the config key that named the split, for messages.
      streaming: data.hf_streaming.
    """

    files: Tuple[str, ...] = ()
    dataset: str = ""
    config_name: str = ""
    name: str = "train"
    key: str = "data.paths"
    streaming: bool = False

    @property
    def label(self) -> str:
        """The split as the user named it, for messages."""
        if self.files:
            return self.files[0] if len(self.files) == 1 else \
                f"{self.key} ({len(self.files)} files)"
        return f"data.hf_dataset={self.dataset}[{self.name}]"

    def signature(self) -> tuple:
        """What the split's rows depend on: the files' sizes and times, else the name."""
        paths = self.files
        if not paths and os.path.isdir(os.path.expanduser(self.dataset)):
            folder = os.path.expanduser(self.dataset)
            paths = tuple(sorted(os.path.join(d, n) for d, _, names in os.walk(folder)
                                 for n in names))
        return (self, tuple((p, os.path.getsize(p), os.stat(p).st_mtime_ns) for p in paths))


def _datasets():
    # Lazy: `datasets` is an optional extra (tfllm[hf-data]) and slow to import.
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.source=hf reads Hugging Face datasets with the datasets "
                        f"package, which is not installed: {INSTALL}.") from None
    return datasets


@contextlib.contextmanager
def _quiet(datasets):
    """`datasets`' progress bars off while tfllm loads (an error stays one line)."""
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def builder_of(files: Tuple[str, ...], key: str) -> str:
    """The `datasets` builder of data files, from their suffix; one type per split."""
    kinds = {}
    for path in files:
        kind = BUILDERS.get(os.path.splitext(path)[1].lower())
        if kind is None:
            raise DataError(f"{key}: {path} is no parquet, JSON, CSV or arrow file (by its "
                            f"suffix, one of {', '.join(BUILDERS)}); name such files, or "
                            "use data.source=text for plain text.")
        kinds.setdefault(kind, path)
    if len(kinds) > 1:
        shown = ", ".join(f"{p} ({k})" for k, p in kinds.items())
        raise DataError(f"{key} mixes file types: {shown}; name files of one type per "
                        "split.")
    return next(iter(kinds))


def check_folder(folder: str, key: str) -> None:
    """A saved dataset folder holds only regular files, inside it, with JSON records of at
    most MAX_RECORD_BYTES: what `datasets` then opens is bounded as tfllm's own reads."""
    top = os.path.realpath(folder)
    for directory, folders, names in os.walk(folder):  # links not walked: checked
        for name in folders + names:
            path = os.path.join(directory, name)
            real = os.path.realpath(path)
            if os.path.commonpath([top, real]) != top:
                raise DataError(f"{key}: {path} leads to {real}, outside {folder} (a "
                                "symbolic link); replace the link by what it names (cp -rL "
                                "copies a folder with its links resolved).")
            st = os.stat(path)
            if name in folders:
                continue
            if not stat.S_ISREG(st.st_mode):
                raise DataError(f"{key}: {path} is no regular file (a FIFO, device or "
                                "socket); a saved dataset folder holds only files.")
            if name.endswith(".json") and st.st_size > MAX_RECORD_BYTES:
                raise DataError(f"{key}: {path} is {st.st_size} bytes, more than a saved "
                                f"dataset's record holds (at most {MAX_RECORD_BYTES}); it "
                                "is no folder save_to_disk wrote.")


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


# Loaded splits, by `Split.signature()`: every row stream and evaluation asks again.
_LOADED: Dict[tuple, object] = {}


def load(split: Split):
    """The split's rows: a `datasets.Dataset` (memory-mapped arrow), or with streaming an
    `IterableDataset`. Bad input is one DataError naming the key and the fix."""
    signature = split.signature()
    if signature in _LOADED:
        return _LOADED[signature]
    datasets = _datasets()
    with _quiet(datasets):
        loaded = _load(datasets, split)
    if len(_LOADED) >= 8:
        _LOADED.clear()
    _LOADED[signature] = loaded
    return loaded


def _split_error(split: Split, e: Exception) -> DataError:
    which = "data.hf_eval_split" if split.key == "data.hf_eval_split" else "data.hf_split"
    return DataError(f"{which}={split.name}: {split.label} has no such split ({_one_line(e)}); "
                     f"set {which} to one of its splits.")


def _load(datasets, split: Split):
    if split.files:
        builder = builder_of(split.files, split.key)
        try:
            return datasets.load_dataset(builder, data_files=list(split.files), split="train",
                                         streaming=split.streaming)
        except Exception as e:  # noqa: BLE001  (pyarrow, json and csv parsers fail in many ways)
            raise DataError(f"{split.key}: datasets cannot read {split.label} as {builder} "
                            f"({_one_line(e)}); fix or re-export the files.") from None
    folder = os.path.expanduser(split.dataset)
    if os.path.isdir(folder):
        return _load_folder(datasets, split, folder)
    if os.path.exists(folder) or split.dataset.startswith((".", "/", "~")):
        raise DataError(f"data.hf_dataset={split.dataset}: no such folder; name a folder "
                        "save_to_disk wrote, or a hub dataset (user/name).")
    try:
        return datasets.load_dataset(split.dataset, split.config_name or None,
                                     split=split.name, streaming=split.streaming)
    except ValueError as e:
        if "split" in str(e).lower():
            raise _split_error(split, e) from None
        raise DataError(f"data.hf_dataset={split.dataset}: {_one_line(e)}; set "
                        "data.hf_config to one of its configurations.") from None
    except Exception as e:  # noqa: BLE001  (not on the hub, offline, not in the cache)
        raise DataError(f"data.hf_dataset={split.dataset}: not a folder, and datasets cannot "
                        f"load it from the hub or its cache ({_one_line(e)}); download it "
                        "where the machine can reach the hub (it is then cached), or name "
                        "a folder save_to_disk wrote, or its files in data.paths.") from None


def _load_folder(datasets, split: Split, folder: str):
    check_folder(folder, "data.hf_dataset")
    if not any(os.path.exists(os.path.join(folder, n))
               for n in ("dataset_dict.json", "state.json")):
        raise DataError(f"data.hf_dataset={split.dataset}: no folder save_to_disk wrote (no "
                        "dataset_dict.json or state.json); name its data files in "
                        "data.paths instead.")
    try:
        saved = datasets.load_from_disk(folder)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"data.hf_dataset={split.dataset}: datasets cannot load the folder "
                        f"({_one_line(e)}); save it again with save_to_disk.") from None
    if isinstance(saved, datasets.DatasetDict):
        if split.name not in saved:
            raise _split_error(split, ValueError(f"it has {sorted(saved)}"))
        saved = saved[split.name]
    elif split.key == "data.hf_eval_split":
        raise DataError(f"data.hf_eval_split={split.name}: {split.dataset} is one saved "
                        "Dataset, not a DatasetDict of splits; leave data.hf_eval_split "
                        "empty (validation is then held out by data.validation_fraction).")
    return saved.to_iterable_dataset() if split.streaming else saved


def column_names(ds) -> List[str]:
    """The columns of a loaded split (a streamed JSON set knows them from its first row)."""
    if ds.column_names is not None:
        return list(ds.column_names)
    first = next(iter(ds.take(1)), None)
    return sorted(first) if first is not None else []


def check_text_column(ds, split: Split, column: str) -> None:
    """`column` exists and holds strings; else one line naming it and the fix."""
    names = column_names(ds)
    if column not in names:
        raise DataError(f"data.text_key={column}: {split.label} has no column {column!r} (it "
                        f"has {names}); set data.text_key to the column holding the text, or "
                        "data.format to the kind of rows it holds.")
    feature = (ds.features or {}).get(column)
    if feature is None:  # a streamed set of unknown types: its first row tells
        first = next(iter(ds.select_columns([column]).take(1)), {}).get(column)
        ok, kind = first is None or isinstance(first, str), type(first).__name__
    else:
        kind = getattr(feature, "dtype", type(feature).__name__)
        ok = kind in ("string", "large_string")
    if not ok:
        raise DataError(f"data.text_key={column}: column {column!r} of {split.label} holds "
                        f"{kind}, not text (strings); set data.text_key to the column "
                        "holding the text.")


class _Blocks:
    """Block `j` of stream `i` of S: rows j*P + i, j*P + i + S, ... below (j + 1) * P
    (P = BLOCK * S) of one column, as a list of str (a null is an empty text)."""

    def __init__(self, ds, column: str, num_shards: int, streaming: bool):
        self.column, self.num_shards, self.streaming = column, num_shards, streaming
        self.per_block = BLOCK * num_shards
        self.rows = ds.select_columns([column])
        if not streaming:
            self.table = self.rows.with_format("arrow")
            self.num_rows = len(self.rows)
        # streaming: stream i's open reader and the block it gives next
        self._readers: Dict[int, list] = {}
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        if self.streaming:  # the end is found by reading: a block past it is empty
            return 2 ** 62 // self.per_block
        return -(-self.num_rows // self.per_block)

    def read(self, block: int, index: int) -> Tuple[List[str], bool]:
        """(texts of the block, whether the block exists)."""
        start = block * self.per_block
        if not self.streaming:
            stop = min(start + self.per_block, self.num_rows)
            if start >= stop:
                return [], False
            texts = self.table[start:stop].column(0).take(
                list(range(index, stop - start, self.num_shards))).to_pylist()
        else:
            with self._lock:  # one reader per stream; tf.data may call from its threads
                reader = self._readers.pop(index, None)
                if reader is None or reader[1] != block:  # first read, resume or repeat
                    rows = self.rows.skip(start) if start else self.rows
                    reader = [iter(rows.iter(batch_size=self.per_block)), block]
                batch = next(reader[0], None)
                if batch is None:
                    return [], False
                reader[1] = block + 1
                self._readers[index] = reader
            texts = batch[self.column][index::self.num_shards]
        return ["" if t is None else t for t in texts], True


def texts(split: Split, column: str, num_shards: int, index) -> tf.data.Dataset:
    """Shard `index` of `num_shards` of the split's column `column`: scalar tf.string
    documents, in row order (see the module docstring).

    Args:
      split: where the rows come from.
      column: data.text_key.
      num_shards: S, the streams the rows are dealt to (one per row of the global batch).
      index: which stream, a Python int or an int64 scalar tensor (a traced stream).
    """
    ds = load(split)
    check_text_column(ds, split, column)
    blocks = _Blocks(ds, column, num_shards, split.streaming)

    def fetch(block, shard):
        found, more = blocks.read(int(block), int(shard))
        return tf.constant(found, tf.string, [len(found)]), tf.constant(more)

    def read(block):
        found, more = tf.py_function(fetch, [block, tf.cast(index, tf.int64)],
                                     [tf.string, tf.bool])
        found.set_shape([None])
        more.set_shape([])
        return found, more

    def exists(found, more):
        return more

    def texts_of(found, more):
        return found
    return (tf.data.Dataset.range(blocks.num_blocks).map(read).take_while(exists)
            .map(texts_of).unbatch())


def _without_nulls(value):
    """`value` with every null-valued key of its dicts dropped (arrow's filled-in keys)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def records(split: Split, fmt: str, parse: Callable) -> list:
    """Every row of the split as the record its JSONL line would give (`parse(line,
    where, fmt)`), `where` naming the split and row.

    Args:
      split: where the rows come from.
      fmt: data.format (messages, prompt_completion or preference).
      parse: `tfllm.data.chat.parse_line` or `tfllm.data.preference.parse_line`.
    """
    ds = load(split)
    names = column_names(ds)
    for column in COLUMNS[fmt]:
        if column not in names:
            raise DataError(f"data.format={fmt}: {split.label} has no column {column!r} (it "
                            f"has {names}); rename the column (Dataset.rename_column) or set "
                            f"data.format to the kind of rows it holds.")
    keep = list(COLUMNS[fmt]) + [c for c in OPTIONAL[fmt] if c in names]
    out = []
    for batch in ds.select_columns(keep).iter(batch_size=1024):
        for values in zip(*(batch[c] for c in keep)):
            where = f"{split.label} row {len(out)}"
            row = _without_nulls(dict(zip(keep, values)))
            try:
                line = json.dumps(row, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise DataError(f"{where}: not JSON data ({_one_line(e)}); give the columns "
                                "strings, lists and structs.") from None
            if len(line.encode("utf-8")) > MAX_LINE_BYTES:
                raise DataError(f"{where}: more than {MAX_LINE_BYTES:,} bytes as JSON (the "
                                "bound on one sample); split or shorten the sample.")
            out.append(parse(line, where, fmt))
    return out
