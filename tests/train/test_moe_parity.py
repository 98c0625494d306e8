"""Training a mixture of experts sharded equals one device, and what expert parallelism
moves.

The tiny llama of the parity harness with experts in both layers (8 experts, top 2,
the aux loss at 0.01 so its gradients are not negligible): the loss, the gathered
gradients of one batch, then 3 AdamW steps (losses, gradient norms, every weight)
on 8 logical CPU devices against the single-device float32 reference, with the
harness's tolerances (tests/harness.py: LOSS_RTOL .. WEIGHT_ATOL, derived there for
reordered float32 sums; the experts add sums of the same kind, and the all-to-alls only
move values). The experts split over the axis of the batch's rows (expert parallelism,
tfllm.parallel.rules): fsdp=8 (one expert per device, the dense parts FSDP) with full
remat and 2 micro-batches, data=2,model=4 (two experts per data group, each expert's
width over model) and fsdp=4,model=2 (the same over fsdp).
Refused in one line: the grouped dispatch on a
mesh, a mesh whose rules split the sequence (data x fsdp), experts that do not divide
over their axis. The routing must agree exactly on both sides for the tolerances to
hold: a flipped top-k choice would move the loss by far more (the routing margins of
random routers at init are ~1e-2, rounding differences ~1e-7).

The executed program of a bfloat16 step on fsdp=8 and data=2,model=4 (`costs.json`'s
collectives): per MoE layer four all-to-alls (the buffer to the experts and back, forward
and backward; six under model.remat=full, which runs the forward's again), each float16
(bfloat16 bits) of exactly the capacity buffer's share of a device; with model > 1 one
tensor-parallel all-reduce of down's output per layer; no gather or reduction of an
expert kernel, no gather of the routing (only (E,) router statistics are reduced).
"""

import pytest

from tests.harness import assert_parity, parity_reference, parity_run
from tfllm.parallel.mesh import parse_axes

EXPERTS = (("model.num_experts", 8), ("model.num_experts_per_tok", 2),
           ("model.moe_intermediate_dim", 32), ("model.router_aux_loss_coef", 0.01))


# Expert-only (fsdp=8, one expert per device) runs with full remat and 2 micro-batches:
# the all-to-alls inside a recomputed block and expert gradients summed over
# micro-batches on the device that owns them, besides the plain expert-only step (a
# separate plain fsdp=8 case added ~100 s of CI for no path of its own).
@pytest.mark.slow
@pytest.mark.parametrize("axes,more", [
    ("data=2,model=4", ()), ("fsdp=4,model=2", ()),
    ("fsdp=8", (("model.remat", "full"), ("train.grad_accum_steps", 2)))],
    ids=["data=2,model=4", "fsdp=4,model=2", "fsdp=8,remat,accumulation"])
def test_moe_training_on_a_mesh_matches_one_device(axes, more):
    extra = EXPERTS + more
    run = parity_run("llama", axes, False, extra)
    ref = parity_reference("llama", False, extra)
    assert_parity(run, ref)
    for got, want in zip(run["history"], ref["history"]):  # the router metrics too
        assert abs(got["moe_aux_loss"] - want["moe_aux_loss"]) <= 1e-5 * want["moe_aux_loss"]
        assert got["moe_load_imbalance"] == pytest.approx(want["moe_load_imbalance"],
                                                          rel=1e-6)
        # the same routing: every expert of every layer gets the same tokens
        assert got["moe_expert_tokens"] == want["moe_expert_tokens"]


#: LoRA on the attention and the experts (tfllm.models.lora: per expert A and B, one A for
#: gate and up), the base frozen
EXPERT_LORA = (("lora.rank", 4), ("lora.alpha", 8.0),
               ("lora.targets", "[q_proj,v_proj,experts.gate_up_proj,experts.down_proj]"))


# data=2,model=4: the adapters' A and B of experts split over data (expert parallelism)
# and their outputs over model; expert-only parallelism is the case above without
# adapters (the adapters follow their experts' layout on any batch axis).
@pytest.mark.slow
@pytest.mark.parametrize("axes", ["data=2,model=4"])
def test_lora_on_the_experts_trains_on_a_mesh_as_on_one_device(axes):
    """The adapters split as their experts do (A (E, D, r) and B (r, E, F) over the
    batch's axis, F over model): the steps equal one device's, and only A and B train
    (the optimizer holds state for them alone; every kernel and the router stay)."""
    extra = EXPERTS + EXPERT_LORA
    run = parity_run("llama", axes, False, extra)
    ref = parity_reference("llama", False, extra)
    assert_parity(run, ref)
    assert all(p.rsplit("/", 1)[-1] in ("lora_a", "lora_b") for p in run["weights"])
    assert any("/mlp/up/lora_b" in p for p in run["weights"])
    assert [v.path for v in run["optimizer"].variables] == run["paths"]


@pytest.mark.parametrize("axes,extra,message", [
    ("fsdp=8", (("model.moe_dispatch", "grouped"),),
     "moe_dispatch=grouped runs on one device only .*all-to-all"),
    ("data=2,fsdp=4", (), "splits each sequence over 'fsdp'"),
    ("fsdp=8", (("model.num_experts", 4),),
     r"model.num_experts \(4\) does not divide over mesh axis 'fsdp' \(size 8\)"),
    ("data=2,model=4", (("mesh.rules", '[["activation_batch", "data"], '
                         '["activation_experts", "data"], ["experts", "model"], '
                         '["embed", null], ["mlp", null], ["heads", "model"], '
                         '["kv_heads", "model"], ["vocab", "model"], ["head_dim", null], '
                         '["position", null], ["norm", null], ["activation_embed", null], '
                         '["activation_length", null], ["activation_heads", "model"], '
                         '["activation_kv_heads", "model"], ["activation_mlp", "model"], '
                         '["activation_head_dim", null], ["activation_vocab", "model"]]'),),
     "the experts split over 'model' but the batch's rows over 'data'")])
def test_meshes_the_dispatch_cannot_run_on_are_refused(axes, extra, message):
    from tests.harness import parity_config
    from tfllm.models import build_model
    from tfllm.parallel import make_parallel
    cfg = parity_config("llama", axes, EXPERTS + extra)
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    with pytest.raises(ValueError, match=message):
        build_model(cfg.model, cfg.precision, cfg.lora, parallel=parallel, allocate=False)


@pytest.mark.slow
@pytest.mark.parametrize("axes,remat,per_layer", [
    ("fsdp=8", "none", 4),
    # the whole block recomputed in the backward pass: its forward's two once more
    ("fsdp=8", "full", 6),
    # the all-to-alls within each data group (2 devices), and tensor parallelism's
    ("data=2,model=4", "none", 4)])
def test_expert_parallelism_moves_the_capacity_buffers_in_16_bits(axes, remat, per_layer):
    from tests.harness import first_step_costs, tiny_config
    layers = 2
    extra = {k: v for k, v in EXPERTS + (("model.remat", remat),)}
    report, _ = first_step_costs(axes, layers, "bfloat16", "llama", **extra)
    cfg = tiny_config("llama", axes, **extra)
    shape = dict(parse_axes(axes))
    n, model = shape.get("data", shape.get("fsdp")), shape.get("model", 1)
    m, batch, length = cfg.model, cfg.train.global_batch_size, cfg.data.sequence_length
    # Dropless: C = T slots per expert and row. A device holds B/n rows of all E experts
    # on the tokens' side and all B rows of E/n experts on the experts' side: either way
    # B * E * C * D / n elements, what each all-to-all exchanges (D is not split over
    # model: each model rank of a data group exchanges the same buffer).
    share = batch * m.num_experts * length * m.hidden_dim // n
    moved = [c for c in report.collectives if c.kind == "all-to-all"]
    assert len(moved) == per_layer * layers, [c.describe() for c in report.collectives]
    for c in moved:
        assert (c.dtype, c.elements, c.group_size) == ("float16", share, n), c.describe()
    # Tensor parallelism: down's partial sums all-reduced over model, once per layer in
    # the forward, on the experts' side of the buffer (E/n x B x C x D, float32 as for
    # the dense MLP's down).
    down = [c for c in report.collectives if "/down_1/einsum" in c.name]
    assert len(down) == (layers if model > 1 else 0), [c.describe() for c in down]
    assert all((c.kind, c.elements, c.group_size) == ("all-reduce", share, model)
               for c in down), [c.describe() for c in down]
    # The expert kernels are neither gathered nor reduced: each device computes and
    # updates its own experts; nor is any row's routing gathered (the plans are per row,
    # the per-expert counts one-hot sums). Every other collective of a MoE layer's
    # forward is a router statistic: a float32 (E,) sum or a scalar. (The dense parts'
    # block gathers and reductions are named per block, not under mlp.)
    for c in report.collectives:
        if c.kind != "all-to-all" and "/mlp" in c.name and c not in down:
            assert (c.elements or 0) <= m.num_experts and c.dtype == "float32", \
                c.describe()
