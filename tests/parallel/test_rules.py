"""Rule resolution as pure functions: no devices."""

import pytest

from tfllm.parallel.rules import (DEFAULT_RULES, BatchLayout, ShardingError,
                                  activation_mesh_axes, batch_layout, resolve_spec,
                                  rules_from_config, sequence_axis, shard_shape,
                                  token_batch_spec, without_sequence_sharding, zero1_spec)
from tfllm.runtime.devices import MeshError

MESH = {"data": 2, "fsdp": 2, "model": 2}


def test_first_unused_rule_wins():
    rules = [("a", "model"), ("b", "model"), ("b", "data")]
    assert resolve_spec("w", (4, 4), ("a", "b"), rules, MESH) == ("model", "data")


def test_none_rule_replicates_and_stops():
    rules = [("a", None), ("a", "model")]
    assert resolve_spec("w", (4,), ("a",), rules, MESH) == (None,)


def test_absent_and_size_one_axes_are_skipped():
    rules = [("batch", "data"), ("batch", "fsdp")]
    assert resolve_spec("x", (8,), ("batch",), rules, {"fsdp": 8}) == ("fsdp",)
    assert resolve_spec("x", (8,), ("batch",), rules, {"data": 1, "fsdp": 4}) == ("fsdp",)
    assert resolve_spec("x", (8,), ("batch",), rules, {"model": 8}) == (None,)


def test_none_logical_axis_is_never_sharded():
    assert resolve_spec("w", (4, 4), (None, "mlp"), DEFAULT_RULES, MESH) == (None, "model")


def test_missing_rule_is_an_error_naming_the_variable():
    with pytest.raises(ShardingError, match=r"gpt/block_0/w: logical axis 'stages' "
                                            r"\(dimension 1\) has no sharding rule"):
        resolve_spec("gpt/block_0/w", (4, 4), ("embed", "stages"), DEFAULT_RULES, MESH)


def test_indivisible_dimension_is_an_error_naming_the_variable():
    with pytest.raises(ShardingError, match=r"llama/attn/key/kernel: dimension 1 \('kv_heads', "
                                            r"size 3\) is not divisible by mesh axis 'model' "
                                            r"\(size 2\)"):
        resolve_spec("llama/attn/key/kernel", (8, 3, 4), ("embed", "kv_heads", "head_dim"),
                     DEFAULT_RULES, MESH)


def test_rank_mismatch_is_an_error():
    with pytest.raises(ShardingError, match="has 2 dimensions but 1 logical axes"):
        resolve_spec("w", (4, 4), ("embed",), DEFAULT_RULES, MESH)


def test_default_table_on_a_3d_mesh():
    r = lambda shape, axes: resolve_spec("w", shape, axes, DEFAULT_RULES, MESH)
    assert r((128, 64), ("vocab", "embed")) == ("model", "fsdp")
    assert r((64, 8, 8), ("embed", "heads", "head_dim")) == ("fsdp", "model", None)
    # data and fsdp both > 1: rows over data, sequence over fsdp (see the next test).
    assert r((8, 16, 64), ("activation_batch", "activation_length", "activation_embed")) == \
        ("data", "fsdp", None)
    assert r((64,), ("norm",)) == (None,)


def test_zero1_shards_first_free_dimension_over_data():
    assert zero1_spec("w", (64, 128), ("fsdp", "model"), MESH) == ("fsdp", "model")
    assert zero1_spec("w", (64,), (None,), MESH) == ("data",)
    assert zero1_spec("w", (3, 64), (None, "model"), MESH) == (None, "model")  # 3 % 2
    assert zero1_spec("w", (3, 8), (None, None), MESH) == (None, "data")
    assert zero1_spec("w", (64,), ("data",), MESH) == ("data",)
    assert zero1_spec("w", (64,), (None,), {"model": 8}) == (None,)


def test_shard_shape_and_rules_from_config():
    assert shard_shape((8, 6), ("data", None), MESH) == (4, 6)
    assert rules_from_config([]) == DEFAULT_RULES
    assert rules_from_config([["embed", None]]) == (("embed", None),)


@pytest.mark.parametrize("mesh, rows, sequence", [
    ({"data": 8}, "data", None),
    ({"fsdp": 8}, "fsdp", None),
    ({"data": 2, "model": 4}, "data", None),
    ({"data": 1, "fsdp": 4, "model": 2}, "fsdp", None),
    ({"data": 2, "fsdp": 4}, "data", "fsdp"),
    ({"data": 2, "fsdp": 2, "model": 2}, "data", "fsdp"),
])
def test_batch_rows_and_sequence_axes(mesh, rows, sequence):
    # Token rows (M, T+1): rows over the batch axis, the odd T+1 never split.
    assert token_batch_spec((8, 17), DEFAULT_RULES, mesh) == (rows, None)
    assert sequence_axis(8, 16, DEFAULT_RULES, mesh) == sequence
    # Every token-splitting axis of size > 1 is used: no device repeats another's work.
    used = {rows, sequence} - {None}
    assert used == {a for a in activation_mesh_axes(DEFAULT_RULES) if mesh.get(a, 1) > 1}


def test_sequence_must_divide_the_sequence_axis():
    with pytest.raises(ShardingError, match="'activation_length', size 15.*'fsdp'"):
        sequence_axis(8, 15, DEFAULT_RULES, {"data": 2, "fsdp": 4})


def test_decoding_rules_never_split_the_sequence():
    rules = without_sequence_sharding(DEFAULT_RULES)
    assert sequence_axis(8, 16, rules, {"data": 2, "fsdp": 4}) is None
    # Weights are laid out as before.
    for shape, axes in (((64, 128), ("embed", "mlp")), ((128, 64), ("vocab", "embed"))):
        assert resolve_spec("w", shape, axes, rules, MESH) == \
            resolve_spec("w", shape, axes, DEFAULT_RULES, MESH)


def test_a_batch_layout_is_one_answer_checked_to_divide():
    # Rows over data, the sequence over fsdp (hybrid); fsdp alone takes the rows.
    assert batch_layout(16, 2, 64, DEFAULT_RULES, {"data": 2, "fsdp": 4}) == BatchLayout(
        8, "data", "fsdp")
    assert batch_layout(16, 1, 30, DEFAULT_RULES, {"fsdp": 4}) == BatchLayout(16, "fsdp", None)
    assert batch_layout(3, 1, 30, DEFAULT_RULES, {"model": 2}) == BatchLayout(3, None, None)
    # The batch's own errors, before the generic sharding error could name a tensor.
    with pytest.raises(MeshError, match=r"= 4 sequences per micro-batch do not divide"):
        batch_layout(16, 4, 64, DEFAULT_RULES, {"data": 8})
    with pytest.raises(MeshError, match=r"data.sequence_length \(30\) does not divide"):
        batch_layout(16, 1, 30, DEFAULT_RULES, {"data": 2, "fsdp": 4})
