"""The embedded corpus: deterministic, cached atomically, train/validation never overlap."""

import json
import os

import tensorflow as tf

from tfllm.data import corpus


def _fake_stdlib(root):
    """A small stand-in for the standard library, with the cases the builder must handle."""
    for i in range(30):
        sub = root / ("pkg" if i % 3 else "") / f"mod{i:02d}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(f'"""Module {i}."""\n\ndef f():\n    return {i}\n', encoding="utf-8")
    (root / "notes.rst").write_text("Notes\n=====\n\ntext\n", encoding="utf-8")
    (root / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))  # skipped
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.py").write_text("skipped = 1\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "y.py").write_text("skipped = 2\n")
    (root / "data.bin").write_bytes(b"\x00\x01")  # not a text suffix


def _read(path):
    spec = {"text": tf.io.FixedLenFeature([], tf.string)}
    return [tf.io.parse_single_example(r, spec)["text"].numpy().decode()
            for r in tf.data.TFRecordDataset(path)]


def test_corpus_is_deterministic_split_and_cached(tmp_path):
    root = tmp_path / "stdlib"
    _fake_stdlib(root)
    docs = corpus.list_documents(str(root))
    assert len(docs) == 31 and [d[0] for d in docs] == sorted(d[0] for d in docs)
    assert not any("latin1" in d[0] or "site-packages" in d[0] or "__pycache__" in d[0]
                   for d in docs)

    m1 = corpus.build_corpus(str(tmp_path / "c1"), 0.2, root=str(root))
    m2 = corpus.build_corpus(str(tmp_path / "c2"), 0.2, root=str(root))
    for split in ("train", "validation"):
        assert m1["splits"][split]["sha256"] == m2["splits"][split]["sha256"]
    train, val = _read(m1["train"]), _read(m1["validation"])
    assert val and not set(train) & set(val)
    assert sorted(train + val) == sorted(text for _, text in docs)
    assert m1["splits"]["train"]["docs"] == len(train)
    # The split is by path hash, so it agrees with in_validation document by document.
    assert sorted(val) == sorted(t for p, t in docs if corpus.in_validation(p, 0.2))


def test_corrupt_or_half_built_cache_is_rebuilt(tmp_path):
    root = tmp_path / "stdlib"
    _fake_stdlib(root)
    m = corpus.build_corpus(str(tmp_path / "c"), 0.2, root=str(root))
    good = open(m["train"], "rb").read()
    with open(m["train"], "r+b") as f:  # flip bytes: the checksum no longer matches
        f.write(b"garbage")
    assert corpus.build_corpus(str(tmp_path / "c"), 0.2, root=str(root))["train"] == m["train"]
    assert open(m["train"], "rb").read() == good
    os.remove(os.path.join(m["dir"], corpus.MANIFEST))  # as if interrupted before the end
    again = corpus.build_corpus(str(tmp_path / "c"), 0.2, root=str(root))
    assert json.load(open(os.path.join(again["dir"], corpus.MANIFEST)))["splits"] == m["splits"]


def test_real_stdlib_corpus_builds(tmp_path):
    """The real corpus: tens of MB, built in about a second."""
    m = corpus.build_corpus(str(tmp_path), 0.02)
    train, val = m["splits"]["train"], m["splits"]["validation"]
    assert train["text_bytes"] > 10e6 and val["docs"] > 0
    assert train["docs"] + val["docs"] == len(corpus.list_documents(corpus.stdlib_root()))


def test_corpus_source_through_batches(tmp_path):
    from tfllm.config import schema
    from tfllm.data.pipeline import Batches
    from tfllm.data.tokenizer import ByteTokenizer

    cfg = schema.Config()
    cfg.data.data_dir, cfg.data.shuffle_buffer = str(tmp_path), 8
    batch = next(Batches(cfg.data, ByteTokenizer(), micro_batches=1, micro_batch_rows=2))
    assert batch["tokens"].shape == (1, 2, cfg.data.sequence_length + 1) and batch["segment_ids"].min() >= 1
    val = next(Batches(cfg.data, ByteTokenizer(), "validation", micro_batches=1,
                       micro_batch_rows=2))
    assert val["segment_ids"][0, :, 0].tolist() == [1, 1]
