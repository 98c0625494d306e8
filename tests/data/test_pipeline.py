"""Packing, shuffling, per-client sharding and iterator save/restore of Batches."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tests.data.conftest import make_docs, text_config
from tfllm.config import schema
from tfllm.data.pipeline import Batches
from tfllm.data.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()


def _take(batches, n):
    return [next(batches) for _ in range(n)]


def _per_row(batches):
    """`batches` reading a pipeline traced per row and zipped (how TFDS sources are
    built, and how every source was before the row template)."""
    batches.dataset = batches._build(per_row=True)
    batches._iterator = iter(batches.dataset)
    return batches


def _reference_rows(docs, tokenizer, length):
    """Rows of `length` packed the slow, obvious way; the last one padded with segment 0."""
    tokens = [t for doc in docs for t in tokenizer.encode(doc) + [tokenizer.eod_id]]
    # Segment ids: number documents within each row, restarting at 1 per row.
    doc_index = [i for i, doc in enumerate(docs)
                 for _ in range(len(tokenizer.encode(doc)) + 1)]
    out = []
    for start in range(0, len(tokens), length):
        row_docs = doc_index[start:start + length]
        first = row_docs[0]
        seg = [d - first + 1 for d in row_docs]
        pad = length - len(row_docs)
        out.append((tokens[start:start + length] + [0] * pad, seg + [0] * pad))
    return out


def test_packing_matches_concatenated_documents(text_cfg):
    """Validation (unshuffled, one stream) = all eval docs + EOD, cut into rows."""
    batches = Batches(text_cfg.data, BYTES, split="validation", micro_batches=1,
                      micro_batch_rows=1)
    got = [(b["tokens"][0, 0].tolist(), b["segment_ids"][0, 0].tolist()) for b in batches]
    docs = make_docs(6, 1)
    assert got == _reference_rows(docs, BYTES, text_cfg.data.sequence_length + 1)
    flat = [t for row, _ in got for t in row]
    assert flat[:len(docs[0]) + 1] == list(docs[0].encode()) + [BYTES.eod_id]


def test_training_rows_are_whole_documents_in_order_of_a_shuffle(text_cfg):
    """Train rows: every token is a doc's token, each doc is followed by EOD, no padding."""
    text_cfg.data.sequence_length = 255
    batch = next(Batches(text_cfg.data, BYTES, micro_batches=1, micro_batch_rows=1))
    tokens, seg = batch["tokens"][0, 0], batch["segment_ids"][0, 0]
    assert tokens.shape == (256,) and tokens.dtype == np.int32 and seg.min() >= 1
    eod = np.flatnonzero(tokens == BYTES.eod_id)
    assert len(eod) >= 2
    # The segment id goes up by one right after each EOD and nowhere else.
    np.testing.assert_array_equal(np.diff(seg), np.isin(np.arange(255), eod).astype(int))
    for start, end in zip(eod[:-1] + 1, eod[1:]):
        assert bytes(tokens[start:end].tolist()).decode() in make_docs(24)


def test_same_seed_same_batches_other_seed_other_batches(tmp_path):
    cfg = text_config(tmp_path)
    kw = dict(micro_batches=1, micro_batch_rows=2)
    a = _take(Batches(cfg.data, BYTES, **kw), 12)
    b = _take(Batches(cfg.data, BYTES, **kw), 12)
    cfg.data.seed += 1
    c = _take(Batches(cfg.data, BYTES, **kw), 12)
    stack = lambda bs: np.stack([x["tokens"] for x in bs])  # noqa: E731
    np.testing.assert_array_equal(stack(a), stack(b))
    assert not np.array_equal(stack(a), stack(c))


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "validation"])
def test_clients_together_get_what_one_client_gets(text_cfg, split):
    """2 and 4 clients holding disjoint rows reproduce the single-client batches."""
    kw = dict(split=split, micro_batches=2, micro_batch_rows=4, max_batches=4)
    whole = _take(Batches(text_cfg.data, BYTES, **kw), 4)
    for parts in ([[0, 1], [2, 3]], [[0, 1, 2], [3]]):
        clients = [_take(Batches(text_cfg.data, BYTES, rows=rows, **kw), 4) for rows in parts]
        for step in range(4):
            for key in ("tokens", "segment_ids"):
                joined = np.concatenate([c[step][key] for c in clients], axis=1)
                np.testing.assert_array_equal(joined, whole[step][key])
    assert whole[0]["tokens"].shape == (2, 4, 16)


def test_save_restore_is_exact_across_epochs(text_cfg, tmp_path):
    """After restore, batches equal the uninterrupted run's, past an epoch boundary."""
    kw = dict(micro_batches=1, micro_batch_rows=2)
    reference = _take(Batches(text_cfg.data, BYTES, **kw), 30)
    first = Batches(text_cfg.data, BYTES, **kw)
    _take(first, 11)
    first.save_state(str(tmp_path / "state" / "client0"))
    resumed = Batches(text_cfg.data, BYTES, **kw)
    resumed.restore_state(str(tmp_path / "state" / "client0"))
    for want, got in zip(reference[11:], _take(resumed, 19)):
        np.testing.assert_array_equal(want["tokens"], got["tokens"])
        np.testing.assert_array_equal(want["segment_ids"], got["segment_ids"])


@pytest.mark.parametrize("split", ["train", "validation"])
def test_the_row_template_reads_what_a_pipeline_per_row_reads(text_cfg, split):
    """The streams are one template traced once and interleaved over row indices (tensors):
    the batches equal those of a pipeline built and zipped per row with Python indices
    (how TFDS sources are built), this client's rows of both micro-batches included."""
    text_cfg.data.validation_fraction = 0.5  # held out by hash, as well as separate files
    text_cfg.data.eval_paths = []
    kw = dict(split=split, rows=[1, 3], micro_batches=2, micro_batch_rows=4)
    template = Batches(text_cfg.data, BYTES, **kw)
    per_row = _per_row(Batches(text_cfg.data, BYTES, **kw))
    n = 12 if split == "train" else None  # validation: all of it, padding to the end
    want = _take(per_row, n) if n else list(per_row)
    got = _take(template, n) if n else list(template)
    assert len(got) == len(want) >= 2 and got[0]["tokens"].shape == (2, 2, 16)
    for a, b in zip(got, want):
        assert sorted(a) == sorted(b) == ["segment_ids", "tokens"]
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_batches_do_not_depend_on_tensorflows_global_seed(text_cfg):
    """The shuffle order is a function of (data.seed, row) only: a global seed set by
    another library (keras.utils.set_random_seed) changes nothing, 0 included (which
    TensorFlow's seed helper cannot compare with a row's seed tensor)."""
    kw = dict(micro_batches=1, micro_batch_rows=2)
    runs = []
    try:
        for seed, per_row in ((None, False), (0, False), (1234, False), (0, True)):
            tf.random.set_seed(seed)
            batches = Batches(text_cfg.data, BYTES, **kw)
            if per_row:
                batches = _per_row(batches)
            runs.append(np.stack([b["tokens"] for b in _take(batches, 4)]))
    finally:
        tf.random.set_seed(None)
    for run in runs[1:]:
        np.testing.assert_array_equal(run, runs[0])


def test_building_a_pipeline_traces_the_same_functions_for_any_number_of_rows(text_cfg):
    """A row's stream is traced once, not once per row: with a pipeline per row, a client
    with 16 rows took 4.9 s to build it and one with 128 rows 42 s
    (benchmarks/data_pipeline.py). The functions of the serialized dataset do not grow
    with the rows."""
    def functions(rows):
        batches = Batches(text_cfg.data, BYTES, micro_batches=2, micro_batch_rows=rows)
        graph = tf.compat.v1.GraphDef.FromString(
            batches.dataset._as_serialized_graph().numpy())
        return len(graph.library.function)
    assert functions(2) == functions(8) > 0


def test_a_position_saved_by_a_pipeline_of_another_shape_is_one_error(text_cfg, tmp_path):
    """A run saved by a pipeline per row (tfllm before the row template, or changed data
    settings) cannot restore its iterator into the template: one DataError naming the fix,
    not TensorFlow's deserialization error."""
    from tfllm.data.errors import DataError
    kw = dict(micro_batches=1, micro_batch_rows=2)
    old = _per_row(Batches(text_cfg.data, BYTES, **kw))
    _take(old, 3)
    old.save_state(str(tmp_path / "state" / "client0"))
    with pytest.raises(DataError, match="saved by a tf.data pipeline of another shape.*"
                                        "start a new --workdir"):
        Batches(text_cfg.data, BYTES, **kw).restore_state(str(tmp_path / "state" / "client0"))


def test_validation_max_batches_pads_and_stops(text_cfg):
    batches = list(Batches(text_cfg.data, BYTES, split="validation", micro_batches=1,
                           micro_batch_rows=2, max_batches=40))
    assert len(batches) == 40 and batches[-1]["segment_ids"].max() == 0
    unbounded = list(Batches(text_cfg.data, BYTES, split="validation", micro_batches=1,
                             micro_batch_rows=2))
    assert 0 < len(unbounded) < 40 and unbounded[-1]["segment_ids"].max() > 0


def test_a_rewound_validation_split_reads_the_same_batches_again(text_cfg):
    # What each evaluation after the first reads (DeviceFeed keeps one validation Batches).
    batches = Batches(text_cfg.data, BYTES, split="validation", micro_batches=1,
                      micro_batch_rows=2, max_batches=5)
    first = _take(batches, 3)  # an evaluation may stop before the end
    batches.rewind()
    again = list(batches)
    assert len(again) == 5
    for want, got in zip(first, again):
        np.testing.assert_array_equal(want["tokens"], got["tokens"])
        np.testing.assert_array_equal(want["segment_ids"], got["segment_ids"])
    assert not all(np.array_equal(a["tokens"], again[0]["tokens"]) for a in again[1:])
    synthetic = dataclasses.replace(text_cfg.data, source="synthetic")
    fake = Batches(synthetic, split="validation", micro_batches=1, micro_batch_rows=2,
                   max_batches=2, vocab_size=64)
    want = list(fake)
    fake.rewind()
    assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(want, list(fake)))
    train = Batches(text_cfg.data, BYTES, micro_batches=1, micro_batch_rows=1)
    with pytest.raises(Exception, match="restored from a checkpoint"):
        train.rewind()


def test_holdout_without_eval_paths_never_overlaps(text_cfg):
    text_cfg.data.eval_paths = []
    text_cfg.data.validation_fraction = 0.3
    from tfllm.data.sources import iterate_documents
    train, val = list(iterate_documents(text_cfg.data, "train")), list(
        iterate_documents(text_cfg.data, "validation"))
    assert val and train and not set(train) & set(val)
    assert sorted(train + val) == sorted(make_docs(24))


def test_separator_splits_a_file_into_documents(tmp_path):
    cfg = text_config(tmp_path)
    (tmp_path / "one.txt").write_text("first doc\n<|endoftext|>\nsecond doc\n")
    cfg.data.paths = [str(tmp_path / "one.txt")]
    from tfllm.data.sources import iterate_documents
    assert list(iterate_documents(cfg.data, "train")) == ["first doc\n", "\nsecond doc\n"]


def test_tfrecord_source(tmp_path):
    cfg = text_config(tmp_path)
    path = str(tmp_path / "docs.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        for doc in make_docs(8):
            feat = tf.train.Feature(bytes_list=tf.train.BytesList(value=[doc.encode()]))
            w.write(tf.train.Example(features=tf.train.Features(
                feature={"body": feat})).SerializeToString())
    cfg.data.source, cfg.data.paths, cfg.data.text_key = "tfrecord", [path], "body"
    cfg.data.eval_paths = [path]
    batches = list(Batches(cfg.data, BYTES, split="validation", micro_batches=1,
                           micro_batch_rows=1))
    assert [(b["tokens"][0, 0].tolist(), b["segment_ids"][0, 0].tolist())
            for b in batches] == _reference_rows(make_docs(8), BYTES, 16)


def test_synthetic_source_through_batches():
    cfg = schema.Config()
    cfg.data.source, cfg.model.vocab_size, cfg.data.sequence_length = "synthetic", 50, 9
    kw = dict(micro_batches=2, micro_batch_rows=4, vocab_size=cfg.model.vocab_size)
    whole = next(Batches(cfg.data, **kw))
    half = next(Batches(cfg.data, rows=[2, 3], **kw))
    assert whole["tokens"].shape == (2, 4, 10) and (whole["segment_ids"] == 1).all()
    np.testing.assert_array_equal(half["tokens"], whole["tokens"][:, 2:])


def test_eval_paths_mean_no_holdout_from_paths(text_cfg):
    from tfllm.data.sources import iterate_documents
    text_cfg.data.validation_fraction = 0.5
    assert sorted(iterate_documents(text_cfg.data, "train")) == sorted(make_docs(24))
    assert sorted(iterate_documents(text_cfg.data, "validation")) == sorted(make_docs(6, 1))


@pytest.mark.slow
def test_one_large_text_file_spreads_over_every_row(tmp_path):
    # One file, no separators: cut into 64-line pieces so all 16 row streams get text;
    # only the document's last piece is followed by the end-of-document token.
    from tfllm.config import load_config
    from tfllm.data.pipeline import Batches
    from tfllm.data.sources import iterate_documents
    from tfllm.data.tokenizer import ByteTokenizer
    text = "".join(f"line {i} of the only document\n" for i in range(64 * 40))
    (tmp_path / "big.txt").write_text(text)
    cfg = load_config(None, [f'data.paths=["{tmp_path}/big.txt"]', "data.source=text",
                             "data.tokenizer=byte", "model.vocab_size=257",
                             "data.validation_fraction=0.1", "data.sequence_length=16",
                             "train.global_batch_size=16"])
    pieces = (list(iterate_documents(cfg.data, "train"))
              + list(iterate_documents(cfg.data, "validation")))
    assert len(pieces) == 40 and sorted(pieces) == sorted(
        "".join(f"line {i} of the only document\n" for i in range(64 * k, 64 * k + 64))
        for k in range(40))
    geometry = dict(micro_batches=1, micro_batch_rows=16)  # the config's global batch of 16
    batch = next(Batches(cfg.data, ByteTokenizer(), "train", **geometry))
    assert batch["tokens"].shape == (1, 16, 17)
    eod = ByteTokenizer().eod_id
    # EOD only at the very end of the document (the piece holding line 2559).
    for _ in range(3):
        tokens = batch["tokens"]
        for row in tokens[0]:
            for i in np.flatnonzero(row == eod):
                assert bytes(row[max(0, i - 9):i].tolist()).endswith(b"document\n")
        batch = next(Batches(cfg.data, ByteTokenizer(), "train", **geometry))
