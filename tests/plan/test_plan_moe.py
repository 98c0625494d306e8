"""`tfllm plan` of a mixture of experts, without compiling: the fit model's arithmetic
(all E experts' state, the dispatched buffers' activations) and the extrapolation over
layers and experts (`planner._extrapolate_experts`) on figures of a known form."""

import dataclasses

import pytest

from tests.harness import tiny_config
from tfllm.config import load_config
from tfllm.footprint import fit
from tfllm.footprint import layout as footprint
from tfllm.plan import planner, sharded

QWEN3_30B = "configs/qwen3-30b-a3b.yaml"


def test_the_qwen3_30b_a3b_config_has_the_models_shapes_and_fits_a_node():
    from tfllm.train.metrics import flops_per_token
    cfg = load_config(QWEN3_30B, ["mesh.axes=fsdp=8"])
    # the model card: 30.5B parameters, 3.3B activated (embeddings excluded there; the
    # active parameters here count the untied head's and the router's matmuls)
    assert footprint.param_count(cfg) == pytest.approx(30.53e9, rel=1e-3)
    active = flops_per_token(cfg.model, cfg.data.sequence_length) / 6
    assert 3.3e9 < active < 3.6e9  # + attention's score FLOPs (the 6N rule counts them)
    e = fit.estimate(cfg, 8, "h100")
    # every expert's weight (4 bytes) and AdamW moments (8) sharded 8 ways
    assert e.state == pytest.approx(30.53e9 * 12 / 8, rel=0.01)
    assert e.fits, e.summary()


def _moe(**model):
    cfg = tiny_config("llama", **{"model.num_experts": 16, "model.num_experts_per_tok": 2,
                                  "model.moe_intermediate_dim": 32,
                                  "model.mlp_only_layers": "[]", **model})
    return cfg


@pytest.mark.parametrize("dispatch, rows_per_token", [
    ("slots", 16),  # dropless: C = T slots for each of the E experts
    # the static buffer: ceil((T k + E (tile - 1)) / tile) tiles of 16 rows (tile = T =
    # 16): ceil((32 + 240) / 16) = 17 tiles, 17 rows per token (every expert may end a
    # tile part full)
    ("grouped", 17),
])
def test_a_sparse_layer_keeps_its_dispatched_buffers(dispatch, rows_per_token):
    cfg = _moe(**{"model.moe_dispatch": dispatch})
    m, length = cfg.model, cfg.data.sequence_length
    assert fit.dispatched_rows(m, length) == rows_per_token
    dense = fit._layer_elements(m, "none", True, length, sparse=False)
    sparse = fit._layer_elements(m, "none", True, length, sparse=True)
    h, f, e = m.hidden_dim, m.moe_intermediate_dim, m.num_experts
    gated = 2 * m.intermediate_dim + m.hidden_dim + 2 * m.intermediate_dim
    assert sparse - dense == (e + rows_per_token * (2 * h + 4 * f) + h) - gated
    # remat=full keeps the block's input only, sparse or not
    assert fit._layer_elements(m, "full", True, length, sparse=True) == h


def test_the_capacity_factor_bounds_the_slots():
    cfg = _moe(**{"model.moe_capacity_factor": 1.0})
    # ceil(1.0 * 16 tokens * 2 / 16 experts) = 2 slots per expert: 16 x 2 / 16 = 2 rows
    assert fit.dispatched_rows(cfg.model, 16) == 2


def test_extrapolation_over_layers_and_experts_recovers_a_bilinear_figure(monkeypatch):
    """Every figure of the form a + L (b + c E) is recovered exactly at (48, 128) from the
    three compiles (1, 16), (2, 16), (1, 32)."""
    def figure(layers, experts, a, b, c):
        return a + layers * (b + c * experts)

    def fake_plan(local, target):
        L, E = local.model.num_layers, local.model.num_experts
        f = lambda *abc: figure(L, E, *abc)  # noqa: E731
        plan = {key: f(3.0, 5.0, 0.25) for key in planner._LINEAR}
        plan["memory"] = {key: f(1e9, 2e8, 1e6) for key in
                          ("arguments", "outputs", "alias", "temp", "total")}
        plan["gemm_targets"] = {"cublas": f(10, 4, 1)}
        plan["roofline_by_kind_s"] = {"gemm": f(0.5, 0.25, 0.125)}
        plan["compile_s"] = 1.0
        calls.append((L, E))
        return plan

    calls = []
    monkeypatch.setattr(planner, "plan_program", fake_plan)
    local = load_config(QWEN3_30B, [])
    # k = 8 with capacity factor 1.25: E1 = 16, where ceil(1.25 T 8 / 16) < T
    assert planner.expert_points(local.model) == (16, 32)
    out = planner._extrapolate_experts(local, None, 48)
    assert sorted(calls) == [(1, 16), (1, 32), (2, 16)]
    for key in planner._LINEAR:
        assert out[key] == pytest.approx(figure(48, 128, 3.0, 5.0, 0.25)), key
    assert out["memory"]["temp"] == pytest.approx(figure(48, 128, 1e9, 2e8, 1e6), rel=1e-12)
    assert out["gemm_targets"]["cublas"] == figure(48, 128, 10, 4, 1)
    assert out["compile_s"] == 3.0
    # layers that are not all sparse compile the real expert count instead
    mixed = dataclasses.replace(local.model, mlp_only_layers=[0])
    assert planner.expert_points(mixed) is None
    # dropless: E1 = max(8, k)
    dropless = dataclasses.replace(local.model, moe_capacity_factor=0.0)
    assert planner.expert_points(dropless) == (8, 16)


def test_the_slots_buffer_is_the_same_at_the_compiled_expert_counts():
    """What makes the line in E exact for a capacity factor: E x C rows at E1, 2 E1, E."""
    from tfllm.models.common.dispatch import expert_capacity
    m = load_config(QWEN3_30B, []).model
    k, cf, length = m.num_experts_per_tok, m.moe_capacity_factor, 2048
    e1, e2 = planner.expert_points(m)
    rows = {e: e * expert_capacity(length, k, e, cf) for e in (e1, e2, m.num_experts)}
    assert set(rows.values()) == {20480}, rows  # 1.25 x 2048 x 8


def test_expert_parallelism_s_all_to_alls_are_in_the_assumed_collectives():
    """fsdp=8 splits the 128 experts 16 per GPU: each sparse layer exchanges the device's
    slots buffer (2 rows x 128 experts x 160 slots x 2048, float16 bits) to the experts
    and back, and its gradient both ways, again under full remat's recomputation: 6
    all-to-alls (tests/train/test_moe_parity.py counts them on the executed program),
    each sending 7/8 of the buffer."""
    cfg = load_config(QWEN3_30B, ["mesh.axes=fsdp=8"])
    local, _ = footprint.per_device_config(cfg, 8)
    buffer = 2 * 128 * 160 * 2048 * 2
    assert sharded.expert_all_to_all_bytes(cfg, local, 8) == 48 * 6 * 7 / 8 * buffer
    no_remat = load_config(QWEN3_30B, ["mesh.axes=fsdp=8", "model.remat=none"])
    assert sharded.expert_all_to_all_bytes(no_remat, local, 8) == 48 * 4 * 7 / 8 * buffer


def test_expert_kernels_are_neither_gathered_nor_reduced_under_expert_parallelism():
    """On fsdp=8 the 128 experts split 16 per GPU and stay there: a block's gather and
    reduction hold its attention, router and norms only (one layer's experts alone are
    128 x 3 x 2048 x 768 = 604M elements)."""
    cfg = load_config(QWEN3_30B, ["mesh.axes=fsdp=8"])
    plan = footprint.mesh_plan(cfg)
    assert plan.experts_split and plan.expert_axis == "fsdp"
    blocks = [u for u in plan.units if u.name.startswith("block")]
    assert len(blocks) == 48
    attention = 2048 * 4096 * 2 + 2048 * 512 * 2  # q, o; k, v
    for u in blocks:
        assert attention <= u.gathered < attention + 2048 * 128 + 3 * 4096, u
    one = load_config(QWEN3_30B, ["mesh.axes=data=1"])
    assert not footprint.mesh_plan(one).experts_split  # one device: nothing splits


def test_the_gpu_memory_check_estimates_a_mixture_of_experts():
    """Where tfllm once warned that it did not model experts, `tfllm train` on GPUs and
    `tfllm doctor` now check an MoE as a dense model: the experts' state counted."""
    from tfllm.footprint.fit import check_host
    from tfllm.runtime.gpu_checks import Gpu
    gpu = Gpu(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), driver="550.54")
    level, message = check_host(_moe(), [gpu], 1)
    assert level == "ok" and "GiB" in message, message


def test_the_program_of_an_expert_parallel_device_holds_its_experts_and_their_slots():
    """fsdp=8 splits Qwen3-30B-A3B's 128 experts 16 per GPU: the program planned at one
    device's shapes (2 of 16 rows) has those 16 experts with 8 x 160 = 1280 slots each,
    the same (rows x experts x slots) buffer as the device's 16 sequences x 16 experts
    x 160 slots after the all-to-all, and the same dispatched rows per token; so its
    float32 gradients exceed a device's by the dense weights' FSDP shards only (not by
    the other 112 experts': 114 GiB with all 128 in the program)."""
    from tfllm.footprint import fit
    from tfllm.models.common.dispatch import expert_capacity
    cfg = load_config(QWEN3_30B, ["mesh.axes=fsdp=8"])
    plan = footprint.mesh_plan(cfg)
    local = plan.local.model
    assert (local.num_experts, plan.local.train.global_batch_size) == (16, 2)
    assert expert_capacity(2048, 8, 16, 1.25) == 8 * expert_capacity(2048, 8, 128, 1.25)
    assert 2 * 16 * 1280 == 16 * 16 * 160
    assert fit.dispatched_rows(local, 2048) == fit.dispatched_rows(cfg.model, 2048)
    program = footprint.mesh_plan(plan.local)
    g = footprint.gradients(plan, program)
    # the excess is the dense weights' alone (embeddings, head, attention, routers:
    # whole in the program, an eighth on the device): 5.0 GiB
    dense = sum(r.bytes_per_device for r in program.rows
                if r.optimizer_bytes_per_device and "experts" not in r.logical_axes)
    assert g.excess == dense - sum(r.bytes_per_device for r in plan.rows
                                   if r.optimizer_bytes_per_device
                                   and "experts" not in r.logical_axes)
    assert g.program - dense == g.device - (dense - g.excess)  # the experts: the same
    # dropless slots have no factor to scale (C = T): the program keeps all 128 experts
    dropless = load_config(QWEN3_30B, ["mesh.axes=fsdp=8", "model.moe_capacity_factor=0"])
    assert footprint.per_device_config(dropless, 8)[0].model.num_experts == 128
