"""Bad input: each gets one DataError naming the file or key and the fix."""

import pytest
import tensorflow as tf

from tests.data.conftest import text_config
from tfllm.data.errors import DataError
from tfllm.data.pipeline import Batches
from tfllm.data.sources import check_tfds_name, iterate_documents
from tfllm.data.tokenizer import ByteTokenizer


def _first(cfg):
    return next(iterate_documents(cfg.data, "train"))


def test_glob_matching_nothing(tmp_path):
    cfg = text_config(tmp_path)
    cfg.data.paths = [str(tmp_path / "nope" / "*.txt")]
    with pytest.raises(DataError, match=r"data.paths: '.*nope/\*.txt' matches no files"):
        _first(cfg)


def test_empty_file(tmp_path):
    cfg = text_config(tmp_path)
    (tmp_path / "train" / "empty.txt").write_bytes(b"")
    cfg.data.paths = [str(tmp_path / "train" / "*.txt")]
    with pytest.raises(DataError, match=r"empty.txt is empty; remove it from data.paths"):
        _first(cfg)


@pytest.mark.parametrize("size", [10, (1 << 20) + 5])  # offsets within and after a block
def test_non_utf8_names_file_and_offset(tmp_path, size):
    cfg = text_config(tmp_path)
    (tmp_path / "bad.txt").write_bytes(b"a" * size + "é".encode("latin-1") + b"tail")
    cfg.data.paths = [str(tmp_path / "bad.txt")]
    with pytest.raises(DataError, match=rf"bad.txt is not UTF-8 at byte offset {size} .*"
                                        "re-encode it as UTF-8"):
        _first(cfg)


def test_tfrecord_without_text_key(tmp_path):
    cfg = text_config(tmp_path)
    path = str(tmp_path / "x.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        feat = tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"hi"]))
        w.write(tf.train.Example(features=tf.train.Features(
            feature={"content": feat})).SerializeToString())
    cfg.data.source, cfg.data.paths = "tfrecord", [path]
    with pytest.raises(DataError, match=r"x.tfrecord has no bytes feature 'text' \(it has "
                                        r"\['content'\]\); set data.text_key"):
        _first(cfg)


def test_unknown_tfds_name_suggests_close_names():
    with pytest.raises(DataError, match=r"data.tfds_name=lmb1: unknown .*Did you mean 'lm1b'"):
        check_tfds_name("lmb1")


def test_fewer_documents_than_rows(tmp_path):
    cfg = text_config(tmp_path, num_docs=3)
    with pytest.raises(DataError, match="needs at least that many documents"):
        next(Batches(cfg.data, ByteTokenizer(), micro_batches=1, micro_batch_rows=4))
