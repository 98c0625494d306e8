"""Per-device shapes and collectives of a sharded plan: pure, no compile, no jax."""

import json
import pytest

from tfllm.compiler.targets import get_target
from tfllm.parallel.rules import DEFAULT_RULES, without_sequence_sharding
from tfllm.plan.planner import figure_sources
from tfllm.footprint.layout import per_device_config
from tfllm.plan.sharded import apply_mesh
from tests.harness import tiny_config


def tiny(axes, **extra):
    return tiny_config("llama", axes, **extra)


@pytest.mark.parametrize("axes, batch, length", [
    ("data=8", 2, 16), ("fsdp=8", 2, 16), ("data=2,model=4", 8, 16),
    # rows over data (8 each), the 16-token sequence over fsdp: folded into 2 rows
    ("data=2,fsdp=4", 2, 16),
])
def test_one_device_computes_its_share_of_the_tokens(axes, batch, length):
    local, note = per_device_config(tiny(axes))
    assert (local.train.global_batch_size, local.data.sequence_length) == (batch, length)
    assert "per device" in note


def test_a_sequence_split_that_does_not_fold_into_rows_shortens_the_sequence():
    # 4 rows: 2 per data group, fewer than the 4 sequence pieces.
    local, _ = per_device_config(tiny("data=2,fsdp=4", **{"train.global_batch_size": 4}))
    assert (local.train.global_batch_size, local.data.sequence_length) == (2, 4)


def _collectives(axes, **extra):
    config = tiny(axes, **{"precision.policy": "bfloat16"}, **extra)
    local, note = per_device_config(config)
    empty = {"memory": {"arguments": 0, "outputs": 0, "alias": 0, "temp": 0}}
    return apply_mesh(config, local, empty, get_target("h100"), note)


def test_sequence_split_adds_the_key_value_gathers():
    hybrid = _collectives("data=2,fsdp=4")
    assert hybrid["batch_shards"] == 8  # every device a distinct eighth of the tokens
    assert "fsdp (sequence): all-gather keys/values" in hybrid["collectives"]["detail"]
    # The same mesh with the sequence never split moves the same weights and gradients;
    # the difference is 2 layers x (gather forward + reduce-scatter backward) x (k and
    # v) x 3/4 of the 8 rows x 16 tokens x 8 kv heads x 4 dims x 2 bytes a device holds.
    rules = json.dumps([list(r) for r in without_sequence_sharding(DEFAULT_RULES)])
    whole = _collectives("data=2,fsdp=4", **{"mesh.rules": rules})
    assert whole["batch_shards"] == 2 and "sequence" not in whole["collectives"]["detail"]
    kv = 2 * 2 * 2 * 3 / 4 * (8 * 16 * 8 * 4 * 2)
    assert (hybrid["collectives"]["bytes_per_device"]
            - whole["collectives"]["bytes_per_device"]) == pytest.approx(kv)


def test_the_adamw_update_and_the_clusters_are_counted_by_the_layout():
    fsdp = _collectives("fsdp=8")
    update = fsdp["optimizer_update"]
    # the no-mesh program updates every weight; on fsdp=8 a device updates an eighth,
    # except the five 64-wide norm scales (2 blocks x 2 + the final norm), replicated
    assert update["layout_params"] * 8 == update["program_params"] + 7 * 5 * 64
    assert update["layout_s"] < update["program_s"] / 7
    # 28 bytes per parameter (AdamW reads w, g, m, v and writes w, m, v in float32)
    assert update["program_s"] == pytest.approx(
        28 * update["program_params"] / get_target("h100").memory_bandwidth)
    # assumed collectives: two gathers and a reduce-scatter per weight; one cluster more
    weights = 2 * 9 + 2  # 2 blocks x (2 norms, q, k, v, o, gate, up, down) + embedding, norm
    assert fsdp["collective_count"] == 3 * weights + 3 * 1  # + the LM head
    assert fsdp["clusters"] == fsdp["collective_count"] + 1
    data = _collectives("data=8")
    # data parallelism replicates the state: each device updates every weight
    assert data["optimizer_update"]["layout_params"] == data["optimizer_update"][
        "program_params"]


def test_measured_clusters_replace_the_assumed_count():
    config = tiny("fsdp=8", **{"precision.policy": "bfloat16"})
    local, note = per_device_config(config)
    empty = {"memory": {"arguments": 0, "outputs": 0, "alias": 0, "temp": 0}}
    m = {"bytes_per_device": 1e9, "link_bandwidth": 450e9, "seconds": 1e9 / 450e9,
         "count": 18, "basis": "measured: ...", "clusters": 61,
         "clusters_basis": "measured: XLA clusters of the busiest device"}
    p = apply_mesh(config, local, empty, get_target("h100"), note, measured=m)
    # DTensor's clusters are not one per collective: the measured count is used as is
    assert (p["collective_count"], p["clusters"]) == (18, 61)
    assert p["clusters_basis"].startswith("measured")
    assert figure_sources(p)["clusters"].startswith("measured")
    # the block buffers are in the memory (modelled from the model's blocks)
    assert p["memory"]["gather_buffers"] > 0 and "units" not in p["memory"]["gather_detail"]


def _memory(axes, accum, temp=10 ** 9, **extra):
    config = tiny(axes, **{"precision.policy": "bfloat16", "train.grad_accum_steps": accum},
                  **extra)
    local, note = per_device_config(config)
    compiled = {"memory": {"arguments": 0, "outputs": 0, "alias": 0, "temp": temp}}
    return apply_mesh(config, local, compiled, get_target("h100"), note)["memory"]


# The tiny llama's trainable weights, by hand: embedding 128 x 64 = 8,192; per block two
# 64-wide norms, q 64 x 64, k and v 64 x 32 (8 key-value heads of 4), o 64 x 64, gate, up
# and down 64 x 128 each: 36,992; 2 blocks; the final norm 64 and the head 64 x 128.
_TINY_PARAMS = 8192 + 2 * 36992 + 64 + 8192
# On fsdp=8 every weight is split 8 ways but the five 64-wide norms (replicated).
_TINY_FSDP8 = (_TINY_PARAMS - 5 * 64) // 8 + 5 * 64


def _uncorrected(m):
    # the layout's state replaced the program's in arguments and outputs (apply_mesh)
    return m["arguments"] + m["outputs"] - m["alias"] + m["temp"] + m["gather_buffers"]


def test_fsdp_gradients_are_the_shards_not_the_compiled_whole_set():
    m = _memory("fsdp=8", 2)
    g = m["gradients"]
    # the no-mesh program computes every float32 gradient whole; a device keeps shards
    assert g["program"] == 4 * _TINY_PARAMS == 361_728
    assert g["device"] == 4 * _TINY_FSDP8 == 46_336
    # under accumulation the whole running sum is alive at the compiled peak: the
    # difference comes off the total, byte for byte
    assert g["excess"] == g["subtracted"] == 361_728 - 46_336
    assert m["total"] == _uncorrected(m) - g["excess"]
    assert "total_low" not in m


def test_one_micro_batch_keeps_the_compiled_total_and_prints_its_lower_bound():
    m = _memory("fsdp=8", 1)
    g = m["gradients"]
    assert g["excess"] == 361_728 - 46_336 and g["subtracted"] == 0
    assert m["total"] == _uncorrected(m)
    assert m["total_low"] == m["total"] - g["excess"]


def test_data_parallel_devices_keep_whole_gradients():
    # data=8 replicates every weight, so its gradients: nothing differs from the program
    g = _memory("data=8", 2)["gradients"]
    assert g["program"] == g["device"] == 4 * _TINY_PARAMS and g["subtracted"] == 0
    # data=2,fsdp=4: split 4 ways (the data axis replicates), norms whole
    g = _memory("data=2,fsdp=4", 2)["gradients"]
    assert g["device"] == 4 * ((_TINY_PARAMS - 5 * 64) // 4 + 5 * 64)
    assert g["subtracted"] == g["program"] - g["device"]
