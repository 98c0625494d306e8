"""Measured collectives of a sharded plan (`tfllm.plan.measured`): a tiny step of the same
mesh run on CPU devices in a child process, classified and scaled to the planned model.
No jax needed: nothing is compiled for a GPU here."""

import math

import pytest

from tfllm.compiler.targets import get_target
from tfllm.plan import measured, sharded
from tfllm.plan.planner import format_plan
from tests.harness import tiny_config


def tiny(axes, **extra):
    return tiny_config("llama", axes, **{"precision.policy": "bfloat16",
                                          **extra})


def test_tiny_weight_kinds_have_distinct_sizes_and_scale_to_the_model():
    config = tiny("data=2,model=2")
    shape = sharded.mesh_shape(config)
    t = measured.tiny_config(config, 2, shape)
    assert t.mesh.axes == "data=2,model=2" and t.precision.policy == "bfloat16"
    sc = measured.scales(config, t, shape)
    kinds = {kind for kind, _ in sc["weights"].values()}
    # q/o, k/v, gate/up/down, embedding/lm head, norms: one size each (per compute layout);
    # and the buffers blocks move their weights in (tfllm.parallel.blocks)
    weights = [kind for kind, _ in sc["weights"].values() if kind != "block"]
    assert len(weights) == 5 and "llama/block/attention/key/kernel" in kinds
    assert "block" in kinds
    # a weight count is that weight; tokens x hidden an activation; <= 1024 small
    size, (kind, s) = next(iter(sc["weights"].items()))
    assert measured.classify(size, sc) == (f"weight {kind}", s)
    assert measured.classify(sc["tokens"] * t.model.hidden_dim, sc)[0] == "activation"
    assert measured.classify(1, sc)[0] == "small"


def _sharded_elements(config, shape):
    rows = sharded.state_bytes(config, shape)[1]
    return {r.path: math.prod(r.shape) for r in rows
            if r.optimizer_bytes_per_device and any(a for a in r.spec)}


# Each measure runs two tiny steps (1 and 2 layers) in a child process: ~40-80 s.
@pytest.mark.slow
def test_fsdp_gathers_every_sharded_weight_twice_in_bf16_and_reduce_scatters_float32():
    config = tiny("fsdp=4")
    shape = sharded.mesh_shape(config)
    m = measured.measure(config, shape, 450e9)
    groups = {(g["kind"], g["dtype"], g["carries"]): g for g in m["groups"]}
    weights = _sharded_elements(config, shape)
    embedding = weights["llama/token_embedding/embeddings"]
    total = sum(weights.values())
    # bf16 travels as float16 bits, gathered forward and again backward; the embedding's
    # lookup needs no weight in its backward, so it is gathered once. Counts are exact:
    # a CollectiveGatherV2 is not merged or padded.
    gathers = groups[("all-gather", "float16", "weights")]
    assert gathers["elements"] == pytest.approx(2 * total - embedding)
    assert gathers["bytes"] == pytest.approx(2 * (2 * total - embedding))
    assert gathers["sent"] == pytest.approx(3 / 4 * gathers["bytes"])
    # gradients: float32, one per sharded weight, a reduce-scatter under NCCL
    scatters = groups[("reduce-scatter", "float32", "weights")]
    # (one all-reduce per tensor since DTensor's combining is off: the replicated norm
    # scales' gradient all-reduces, 5 x hidden, are sized like weights and land here too)
    norms = 5 * 64
    assert total <= scatters["elements"] <= total + norms
    assert scatters["bytes"] == 4 * scatters["elements"]
    # nothing else but scalars and the replicated norms' gradients
    rest = [g for k, g in groups.items() if k[2] not in ("weights",)]
    assert all(g["carries"] == "small" for g in rest)
    assert "measured" in m["basis"]


@pytest.mark.slow
def test_data_and_model_move_float32_gradients_and_activations():
    config = tiny("data=2,model=2")
    shape = sharded.mesh_shape(config)
    m = measured.measure(config, shape, 450e9)
    carried = {(g["kind"], g["dtype"], g["carries"]) for g in m["groups"]}
    # DTensor upcasts bf16 reductions: the activations' all-reduces over model are float32
    assert ("all-reduce", "float32", "activation") in carried
    # the gradients over data: per weight or merged into padded buffers, float32
    assert carried & {("all-reduce", "float32", "weights"),
                      ("all-reduce", "float32", "merged gradients")}
    assert not any(k[1] == "bfloat16" for k in carried)
    # labelled beside the assumed figure when a plan carries both
    local, note = sharded.per_device_config(config)
    empty = {"memory": {"arguments": 0, "outputs": 0, "alias": 0, "temp": 0}}
    p = sharded.apply_mesh(config, local, empty, get_target("h100"), note, measured=m)
    assert p["collectives"] is m and p["collectives_assumed"]["basis"].startswith("assumed")
    assert p["collective_s"] == m["seconds"]


def test_gather_buffers_are_two_blocks_in_bf16_and_one_float32_gradient():
    config = tiny("fsdp=4")
    b = sharded.gather_buffers(config, sharded.mesh_shape(config))
    h, i, v = 64, 128, 128
    block = h * 16 * 4 * 2 + h * 8 * 4 * 2 + 3 * h * i + h * 2  # q, o; k, v; mlp; norms
    assert b["gathered"] == 2 * max(block, v * h) * 2
    assert b["gradient"] == max(v * h, h * i) * 4
    assert sharded.gather_buffers(tiny("data=4"), {"data": 4})["bytes"] == 0
