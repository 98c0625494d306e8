"""One block's program as a mesh device runs it (`tfllm.plan.block_program`), compiled for
an H100: the block buffers and remat's live buffers of `tfllm plan` come from its compile."""

import copy
import importlib.util

import pytest

from tfllm.compiler.targets import get_target
from tfllm.footprint import layout as footprint
from tfllm.plan.block_program import block_memory
from tfllm.plan.planner import format_plan, plan, plan_block, plan_program
from tests.harness import tiny_config

needs_jax = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is None,
    reason="the plan extra is not installed (pip install -e '.[plan]')")


def test_block_buffers_are_the_weights_and_gradients_the_compile_assigned():
    desc = {"activation_bytes": 300, "token_bytes": 8, "weight_bytes": 40,
            "neighbour_bytes": 40, "gradient_bytes": 80}
    compiled = {"arguments": 150 + 8 + 80, "outputs": 150 + 80 + 4, "alias": 0,
                "temp": 1000}
    m = block_memory(desc, compiled)
    assert m["peak"] == compiled["arguments"] + compiled["outputs"] + 1000
    # parameters and outputs less the activations and token ids: the two blocks'
    # weights, the float32 gradients and the neighbour's touched scalar
    assert m["block_buffers"] == 80 + 80 + 4
    assert m["recompute"] == 1000


def _local(**extra):
    cfg = tiny_config("llama", **{"precision.policy": "bfloat16", "model.remat": "full",
                                  **extra})
    return cfg, footprint.per_device_config(cfg, None)[0]


@needs_jax
@pytest.mark.slow
def test_the_block_program_holds_two_blocks_gathered_and_one_block_of_float32_gradients():
    cfg, local = _local(**{"mesh.axes": "fsdp=2"})
    block = plan_block(local, get_target("h100"))
    units = [u for u in footprint.mesh_plan(cfg).units if u.name.startswith("block")]
    # every weight of a tiny llama block in its compute layout, 2 bytes each (bfloat16)
    assert block["weights"] == 2 * (units[0].reduced + units[1].reduced)
    assert block["gradients"] == 4 * units[0].reduced
    # XLA's parameter and output buffers less the activations are exactly those, with
    # the 4-byte scalar that keeps the neighbour's weights alive and XLA's 8-byte index
    # of each of the 12 outputs (y, dx, 9 gradients, the scalar)
    assert block["block_buffers"] == block["weights"] + block["gradients"] + 4 + 8 * 12
    assert block["recompute"] > 0 and block["micro_rows"] == local.train.global_batch_size


@needs_jax
@pytest.mark.slow
def test_the_block_program_computes_what_a_layer_adds_to_the_step():
    # remat=full: a layer of the step is its forward, its recomputation and its backward,
    # which is the block program's work: its GEMM FLOPs are the step's per-layer slope,
    # exactly (GEMM FLOPs are shapes), and 1 layer + 2 blocks is the 3-layer step
    _, local = _local()
    target = get_target("h100")
    steps = {}
    for layers in (1, 3):
        c = copy.deepcopy(local)
        c.model.num_layers = layers
        steps[layers] = plan_program(c, target)
    block = plan_block(local, target)
    assert steps[1]["flops"] + 2 * block["flops"] == pytest.approx(steps[3]["flops"],
                                                                   rel=1e-9)
    # kernels: XLA fuses a block alone a little differently than inside the step (the
    # neighbour's touch, the float32 casts of its gradients as outputs); 15%
    assert steps[1]["kernels"] + 2 * block["kernels"] == pytest.approx(
        steps[3]["kernels"], rel=0.15)


@needs_jax
@pytest.mark.slow
def test_a_mesh_plan_counts_the_compiled_block_buffers_and_prints_the_fit_model_beside():
    cfg, _ = _local(**{"mesh.axes": "fsdp=2"})
    p = plan(cfg, collectives="assumed")
    m, mm = p.memory, p.mesh.memory
    assert mm.block_buffers == mm.block_program["block_buffers"]
    # the compiled block's buffers, or the model's where its peak is the embedding's or
    # the head's unit, which no block program holds
    counted = mm.counted
    assert counted == max(mm.block_buffers, mm.buffers.bytes) or (
        counted == mm.block_buffers and mm.buffers.unit.startswith("block_"))
    assert m.total == m.arguments + m.outputs - m.alias + m.temp + counted
    assert mm.buffers.bytes > 0  # the model's figure stays beside the compile's
    f = p.fit
    assert f["peak"] > f["state"] > 0 and "recomputed_block" in f["detail"]
    assert p.sources["memory"].count("compiled") >= 2
    text = format_plan(p)
    assert "block buffers" in text and "compiled: one block's program" in text
    assert "fit model" in text and "one block's backward" in text
