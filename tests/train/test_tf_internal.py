"""Collecting the executed graphs of one call leaves nothing collecting afterwards."""

import tensorflow as tf
from tensorflow.python.eager import context

from tfllm.train.tf_internal import collect_executed_graphs


def test_collection_stops_at_the_end_of_the_block():
    inside = tf.function(lambda x: x * 2.0, autograph=False)
    with collect_executed_graphs() as graphs:
        inside(tf.ones(2))
    assert len(graphs()) >= 1
    # A function first run after the block must not be stored: TensorFlow kept every
    # later function's graph when graph collection was disabled before run metadata,
    # until a long test session's store grew too large to parse.
    after = tf.function(lambda x: x + 1.0, autograph=False)
    after(tf.ones(3))
    metadata = context.context().export_run_metadata()
    assert len(metadata.function_graphs) == 0
