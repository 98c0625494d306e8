"""TFDS source through tfds.testing.mock_data (nothing can be downloaded)."""

import numpy as np
import pytest

from tfllm.config import schema
from tfllm.data.pipeline import Batches
from tfllm.data.tokenizer import ByteTokenizer


def test_tfds_mock_batches_and_client_split(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    cfg = schema.Config()
    cfg.data.source, cfg.data.tfds_name, cfg.data.sequence_length = "tfds", "lm1b", 15
    cfg.data.shuffle_buffer = 8
    with tfds.testing.mock_data(num_examples=12):
        whole = next(Batches(cfg.data, ByteTokenizer(), micro_batches=1, micro_batch_rows=2))
        half = next(Batches(cfg.data, ByteTokenizer(), rows=[1], micro_batches=1,
                            micro_batch_rows=2))
        val = next(Batches(cfg.data, ByteTokenizer(), split="validation", micro_batches=1,
                           micro_batch_rows=2))
    assert whole["tokens"].shape == (1, 2, 16) and whole["segment_ids"].min() >= 1
    np.testing.assert_array_equal(half["tokens"], whole["tokens"][:, 1:])
    assert val["tokens"].shape == (1, 2, 16)
