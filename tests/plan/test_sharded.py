"""Per-device shapes and collectives of a sharded plan: pure, no compile, no jax."""

import dataclasses
import json

import pytest

from tfllm.compiler.targets import get_target
from tfllm.parallel.rules import DEFAULT_RULES, without_sequence_sharding
from tfllm.plan.planner import finish
from tfllm.plan.result import PlanResult
from tfllm.footprint.layout import mesh_plan, per_device_config
from tfllm.plan.sharded import mesh_figures
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


def _plan(axes, accum=1, temp=0, measured=None, **extra) -> PlanResult:
    """The plan of a mesh device around a compiled program whose memory is `temp`
    bytes of temporaries and nothing else (no compile)."""
    config = tiny(axes, **{"precision.policy": "bfloat16", "train.grad_accum_steps": accum},
                  **extra)
    target, plan = get_target("h100"), mesh_plan(config)
    figures = mesh_figures(config, plan, mesh_plan(plan.local), target, measured=measured)
    compiled = {"memory": {"arguments": 0, "outputs": 0, "alias": 0, "temp": temp,
                           "total": temp},
                "roofline_s": 1e-3, "tokens_per_step": 1, "model_flops": 1.0}
    return finish(compiled, figures, config, target, "by hand")


def _collectives(axes, **extra):
    return _plan(axes, **extra).mesh


def test_sequence_split_adds_the_key_value_gathers():
    hybrid = _collectives("data=2,fsdp=4")
    assert hybrid.batch_shards == 8  # every device a distinct eighth of the tokens
    assert "fsdp (sequence): all-gather keys/values" in hybrid.collectives.detail
    # The same mesh with the sequence never split moves the same weights and gradients;
    # the difference is 2 layers x (gather forward + reduce-scatter backward) x (k and
    # v) x 3/4 of the 8 rows x 16 tokens x 8 kv heads x 4 dims x 2 bytes a device holds.
    rules = json.dumps([list(r) for r in without_sequence_sharding(DEFAULT_RULES)])
    whole = _collectives("data=2,fsdp=4", **{"mesh.rules": rules})
    assert whole.batch_shards == 2 and "sequence" not in whole.collectives.detail
    kv = 2 * 2 * 2 * 3 / 4 * (8 * 16 * 8 * 4 * 2)
    assert (hybrid.collectives.bytes_per_device
            - whole.collectives.bytes_per_device) == pytest.approx(kv)


def test_the_adamw_update_and_the_clusters_are_counted_by_the_layout():
    fsdp = _collectives("fsdp=8")
    update = fsdp.optimizer_update
    # the no-mesh program updates every weight; on fsdp=8 a device updates an eighth,
    # except the five 64-wide norm scales (2 blocks x 2 + the final norm), replicated
    assert update["layout_params"] * 8 == update["program_params"] + 7 * 5 * 64
    assert update["layout_s"] < update["program_s"] / 7
    # 28 bytes per parameter (AdamW reads w, g, m, v and writes w, m, v in float32)
    assert update["program_s"] == pytest.approx(
        28 * update["program_params"] / get_target("h100").memory_bandwidth)
    # assumed collectives: two gathers and a reduce-scatter per weight; one cluster more
    weights = 2 * 9 + 2  # 2 blocks x (2 norms, q, k, v, o, gate, up, down) + embedding, norm
    assert fsdp.collective_count == 3 * weights + 3 * 1  # + the LM head
    assert fsdp.clusters == fsdp.collective_count + 1
    data = _collectives("data=8")
    # data parallelism replicates the state: each device updates every weight
    assert data.optimizer_update["layout_params"] == data.optimizer_update[
        "program_params"]


def test_measured_clusters_replace_the_assumed_count():
    m = {"bytes_per_device": 1e9, "link_bandwidth": 450e9, "seconds": 1e9 / 450e9,
         "count": 18, "basis": "measured: ...", "detail": "by hand", "clusters": 61,
         "clusters_basis": "measured: XLA clusters of the busiest device"}
    p = _plan("fsdp=8", measured=m)
    # DTensor's clusters are not one per collective: the measured count is used as is
    assert (p.mesh.collective_count, p.mesh.clusters) == (18, 61)
    assert p.mesh.clusters_basis.startswith("measured")
    assert p.sources["clusters"].startswith("measured")
    # the layout's formula stays beside the measured collectives, job by job
    assumed = p.mesh.collectives_assumed
    assert [(t.axis, t.what) for t in assumed.traffic] == [
        ("fsdp", "all-gather weights"), ("fsdp", "reduce-scatter grads")]
    assert assumed.bytes_per_device == sum(t.bytes for t in assumed.traffic)
    # the block buffers are in the memory (modelled from the model's blocks)
    assert p.mesh.memory.buffers.bytes > 0
    assert "units" not in p.to_json()["memory"]["gather_detail"]


def test_a_plan_reads_back_from_its_json_as_the_same_value():
    m = {"bytes_per_device": 1e9, "link_bandwidth": 450e9, "seconds": 1e9 / 450e9,
         "count": 18, "basis": "measured: ...", "detail": "by hand", "clusters": 61,
         "clusters_basis": "measured: XLA clusters of the busiest device"}
    for p in (_plan("fsdp=8", 2, 10 ** 9, measured=m), _plan("data=2,model=4", 1, 10 ** 9)):
        stored = json.loads(json.dumps(p.to_json()))
        assert PlanResult.from_json(stored).to_json() == stored
        back = PlanResult.from_json(stored)
        assert (back.memory, back.estimate.step_s, back.mesh.collectives.detail) == (
            p.memory, p.estimate.step_s, p.mesh.collectives.detail)


def _memory(axes, accum, temp=10 ** 9, **extra):
    p = _plan(axes, accum, temp, **extra)
    return p.memory, p.mesh.memory


# The tiny llama's trainable weights, by hand: embedding 128 x 64 = 8,192; per block two
# 64-wide norms, q 64 x 64, k and v 64 x 32 (8 key-value heads of 4), o 64 x 64, gate, up
# and down 64 x 128 each: 36,992; 2 blocks; the final norm 64 and the head 64 x 128.
_TINY_PARAMS = 8192 + 2 * 36992 + 64 + 8192
# On fsdp=8 every weight is split 8 ways but the five 64-wide norms (replicated).
_TINY_FSDP8 = (_TINY_PARAMS - 5 * 64) // 8 + 5 * 64


def _uncorrected(m, mm):
    # the layout's state replaced the program's in arguments and outputs (mesh_figures)
    return m.arguments + m.outputs - m.alias + m.temp + mm.buffers.bytes


def test_fsdp_gradients_are_the_shards_not_the_compiled_whole_set():
    m, mm = _memory("fsdp=8", 2)
    g = mm.gradients
    # the no-mesh program computes every float32 gradient whole; a device keeps shards
    assert g.program == 4 * _TINY_PARAMS == 361_728
    assert g.device == 4 * _TINY_FSDP8 == 46_336
    # under accumulation the whole running sum is alive at the compiled peak: the
    # difference comes off the total, byte for byte
    assert g.excess == g.subtracted == 361_728 - 46_336
    assert m.total == _uncorrected(m, mm) - g.excess
    assert m.total_low is None


def test_one_micro_batch_keeps_the_compiled_total_and_prints_its_lower_bound():
    m, mm = _memory("fsdp=8", 1)
    g = mm.gradients
    assert g.excess == 361_728 - 46_336 and g.subtracted == 0
    assert m.total == _uncorrected(m, mm)
    assert m.total_low == m.total - g.excess


def test_data_parallel_devices_keep_whole_gradients():
    # data=8 replicates every weight, so its gradients: nothing differs from the program
    g = _memory("data=8", 2)[1].gradients
    assert g.program == g.device == 4 * _TINY_PARAMS and g.subtracted == 0
    # data=2,fsdp=4: split 4 ways (the data axis replicates), norms whole
    g = _memory("data=2,fsdp=4", 2)[1].gradients
    assert g.device == 4 * ((_TINY_PARAMS - 5 * 64) // 4 + 5 * 64)
    assert g.subtracted == g.program - g.device


def test_a_plan_resolves_the_rules_and_builds_the_model_once_per_mesh_plan(monkeypatch):
    """The mesh is worked out once (`mesh_plan`): the state, units, block buffers,
    gradients, collectives and the plan's figures read that value and rebuild nothing
    (the planner of dicts rebuilt both for each figure: six models per mesh plan)."""
    import tfllm.models
    from tfllm.parallel import rules as rules_lib
    calls = {"rules": 0, "model": 0}
    real_rules, real_build = rules_lib.rules_from_config, tfllm.models.build_model

    def rules_counted(*a, **k):
        calls["rules"] += 1
        return real_rules(*a, **k)

    def build_counted(*a, **k):
        calls["model"] += 1
        return real_build(*a, **k)

    monkeypatch.setattr(rules_lib, "rules_from_config", rules_counted)
    monkeypatch.setattr(tfllm.models, "build_model", build_counted)
    config = tiny("fsdp=8", **{"precision.policy": "bfloat16"})
    plan = mesh_plan(config)
    assert calls == {"rules": 1, "model": 1}
    program = mesh_plan(plan.local)  # the one-device program's own plan
    assert calls == {"rules": 2, "model": 2}
    figures = mesh_figures(config, plan, program, get_target("h100"))
    compiled = {"memory": {"arguments": 0, "outputs": 0, "alias": 0, "temp": 0, "total": 0},
                "roofline_s": 1e-3, "tokens_per_step": 1, "model_flops": 1.0}
    result = finish(compiled, figures, config, get_target("h100"), "by hand")
    assert calls == {"rules": 2, "model": 2}
    assert result.mesh.memory.buffers == plan.buffers and result.devices == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.memory = None


def test_expert_all_to_alls_are_on_the_critical_path():
    """FSDP's gathers and reductions hide behind the blocks' compute; the experts'
    all-to-alls wait on their layer's routing and the experts on them: exposed whole."""
    experts = {"model.num_experts": 8, "model.num_experts_per_tok": 2,
               "model.moe_intermediate_dim": 32, "model.moe_capacity_factor": 1.25}
    p = _plan("fsdp=8", temp=0, **experts)
    t = p.estimate.step_time
    moved = [a for a in p.mesh.collectives.traffic if a.axis == "fsdp (experts)"]
    assert len(moved) == 1 and moved[0].what == "all-to-all dispatched tokens"
    critical = moved[0].bytes / p.mesh.collectives.link_bandwidth
    assert t["critical_collective_s"] == pytest.approx(critical) and critical > 0
    from tfllm.plan import timing
    rest = timing.exposed_collective_seconds(t["collective_s"] - critical, t["compute_s"]
                                             + t["launch_s"], p.mesh.blocks, True)
    assert t["exposed_collective_s"] == pytest.approx(critical + rest)
    # a dense model has nothing on the critical path of an fsdp mesh
    assert _plan("fsdp=8").estimate.step_time["critical_collective_s"] == 0
