"""Training a mixture of experts sharded equals one device.

The tiny llama of the parity harness with experts in both layers (4 experts, top 2,
the aux loss at 0.01 so its gradients are not negligible): the loss, the gathered
gradients of one batch, then 3 AdamW steps (losses, gradient norms, every weight)
on 8 logical CPU devices against the single-device float32 reference, with the
harness's tolerances (tests/harness.py: LOSS_RTOL .. WEIGHT_ATOL, derived there for
reordered float32 sums; the experts add sums of the same kind). The experts are
replicated over the experts dimension and sharded as the dense MLP (embed over fsdp):
FSDP gathers them like any block's weights and model parallelism splits each expert's
width (tfllm.parallel.rules). Refused in one line (tfllm.models.check_experts_mesh): the
grouped dispatch on a mesh, and a mesh whose rules split the sequence (data x fsdp).
The routing must
agree exactly on both sides for the tolerances to hold: a flipped top-k choice would
move the loss by far more (the routing margins of random routers at init are ~1e-2,
rounding differences ~1e-7).
"""

import pytest

from tests.harness import assert_parity, parity_reference, parity_run

EXPERTS = (("model.num_experts", 4), ("model.num_experts_per_tok", 2),
           ("model.moe_intermediate_dim", 32), ("model.router_aux_loss_coef", 0.01))


@pytest.mark.slow
@pytest.mark.parametrize("axes", ["fsdp=8", "data=2,model=4", "fsdp=4,model=2"])
def test_moe_training_on_a_mesh_matches_one_device(axes):
    extra = EXPERTS
    run = parity_run("llama", axes, False, extra)
    ref = parity_reference("llama", False, extra)
    assert_parity(run, ref)
    for got, want in zip(run["history"], ref["history"]):  # the router metrics too
        assert abs(got["moe_aux_loss"] - want["moe_aux_loss"]) <= 1e-5 * want["moe_aux_loss"]
        assert got["moe_load_imbalance"] == pytest.approx(want["moe_load_imbalance"],
                                                          rel=1e-6)


@pytest.mark.parametrize("axes,dispatch,message", [
    ("fsdp=8", "grouped", "moe_dispatch=grouped runs on one device only"),
    ("data=2,fsdp=4", "slots", "splits each sequence over 'fsdp'")])
def test_meshes_the_dispatch_cannot_run_on_are_refused(axes, dispatch, message):
    from tests.harness import parity_config
    from tfllm.models import build_model
    from tfllm.parallel import make_parallel
    cfg = parity_config("llama", axes, EXPERTS + (("model.moe_dispatch", dispatch),))
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    with pytest.raises(ValueError, match=message):
        build_model(cfg, parallel, allocate=False)
