"""Mixture-of-experts blocks inside the llama model and its train step.

Which layers are sparse (Qwen3-MoE's decoder_sparse_step and mlp_only_layers); the step's
loss is the LM loss plus router_aux_loss_coef x the load-balancing loss of every sparse
layer's statistics, with the router metrics in the step's output (so in metrics.jsonl),
the same under full remat (the statistics leave the recomputed block as its outputs);
the FLOP count takes the active parameters (the router and k of E experts); the config
refuses what cannot be built; the experts' kernels lay out on a mesh by the rules table.
The model's numbers against transformers' are tests/pretrained/test_moe_families.py's.

Tolerances: float32. The step's loss and our recomputation of it add the same float32
terms (rtol 1e-6: the same ops, at most reassociated by the graph). Full remat runs the
same ops again: losses and gradients within the parity harness's float32 tolerances
(tests/harness.py: LOSS_RTOL, GRAD_RTOL), a few ulps in practice.
"""

import dataclasses

import io

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import GRAD_RTOL, LOSS_RTOL, sections, tiny_config
from tfllm.config import ConfigError, load_config
from tfllm.data import SyntheticTokens, feed
from tfllm.models import build_model
from tfllm.models.common.moe import (MoeMLP, collecting_router_stats, load_balancing_loss,
                                     router_z_loss)
from tfllm.models.loss import token_nll
from tfllm.train.metrics import flops_per_token
from tfllm.train.state import build_train_state

MOE = {"model.num_experts": 4, "model.num_experts_per_tok": 2,
       "model.moe_intermediate_dim": 32, "model.num_layers": 3,
       "model.mlp_only_layers": "[0]", "model.router_aux_loss_coef": 0.01}


def _config(**extra):
    return tiny_config("llama", **{**MOE, **extra})


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    # transformers' Qwen3-MoE: sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    cfg = _config(**{"model.num_layers": 6, "model.decoder_sparse_step": 2,
                     "model.mlp_only_layers": "[3]"})
    model = build_model(*sections(cfg), allocate=False)
    kinds = [isinstance(b.mlp, MoeMLP) for b in model.blocks]
    assert kinds == [False, True, False, False, False, True]
    # Mixtral: every layer
    model = build_model(*sections(_config(**{"model.mlp_only_layers": "[]"})), allocate=False)
    assert all(isinstance(b.mlp, MoeMLP) for b in model.blocks)


def _batch(cfg, index=0):
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=7)
    t = cfg.train
    return feed.to_device(None, data.batch(index, t.global_batch_size, t.grad_accum_steps))


@pytest.mark.parametrize("z_loss", [0.0, 0.1])
def test_step_loss_adds_the_aux_loss_and_reports_router_metrics(z_loss):
    cfg = _config(**{"model.router_z_loss_coef": z_loss})
    state = build_train_state(cfg, None, jit_compile=False)
    batch = _batch(cfg)
    loss, _, metrics = state.step.loss_and_grads(batch, with_metrics=True)
    tokens = batch[0]  # the only micro-batch (M, T + 1)
    with collecting_router_stats() as stats:
        logits = state.model(tokens[:, :-1])
    assert len(stats) == 2  # layers 1 and 2; layer 0 is dense
    lm = float(tf.reduce_mean(token_nll(logits, tokens[:, 1:])))
    aux, z = float(load_balancing_loss(stats)), float(router_z_loss(stats))
    assert aux > 1.0  # E * sum f P: 1 exactly when balanced; random routing is not
    np.testing.assert_allclose(loss, lm + 0.01 * aux + z_loss * z, rtol=1e-6)
    np.testing.assert_allclose(metrics["moe_aux_loss"], aux, rtol=1e-6)
    np.testing.assert_allclose(metrics["moe_z_loss"], z, rtol=1e-6)
    counts = [s.expert_counts.numpy() for s in stats]
    imbalance = max(c.max() / c.mean() for c in counts)
    np.testing.assert_allclose(metrics["moe_load_imbalance"], imbalance, rtol=1e-6)
    assert metrics["moe_dropped_fraction"] == 0.0  # dropless
    # each sparse layer's per-expert assignments, exactly
    np.testing.assert_array_equal(metrics["moe_expert_tokens"], np.stack(counts))
    # The train step reports them beside the loss (what metrics.jsonl records).
    out = state.step(batch)
    assert {"moe_aux_loss", "moe_z_loss", "moe_load_imbalance",
            "moe_dropped_fraction", "moe_expert_tokens"} <= set(out)


def test_a_run_records_each_expert_s_tokens_in_metrics_jsonl_and_tensorboard(tmp_path):
    """metrics.jsonl holds moe_expert_tokens as lists of whole numbers (sparse layers x
    experts); TensorBoard a histogram per sparse layer; trackers (scalars only) skip it."""
    import glob
    from tensorflow.core.util import event_pb2
    from tests.harness import metrics_records
    from tfllm.train.loop import train
    cfg = _config(**{"train.steps": 2, "train.log_every": 1})
    train(cfg, str(tmp_path), out=io.StringIO())
    records = [r for r in metrics_records(tmp_path) if "loss" in r]
    assert len(records) == 2
    for r in records:
        counts = np.array(r["moe_expert_tokens"])
        assert counts.shape == (2, 4) and counts.dtype.kind == "i"
        # every token of the step's 16 rows x 16 positions chooses k = 2 experts
        assert (counts.sum(axis=1) == cfg.train.global_batch_size
                * cfg.data.sequence_length * 2).all()
    tags = set()
    for path in glob.glob(f"{tmp_path}/tensorboard/events.out.tfevents.*"):
        for record in tf.data.TFRecordDataset(path):
            tags |= {v.tag for v in event_pb2.Event.FromString(record.numpy()).summary.value}
    assert {"moe_expert_tokens/sparse_layer_0", "moe_expert_tokens/sparse_layer_1",
            "moe_aux_loss", "loss"} <= tags


def test_capacity_factor_drops_and_reports_it():
    cfg = _config(**{"model.moe_capacity_factor": 0.5})
    state = build_train_state(cfg, None, jit_compile=False)
    _, _, metrics = state.step.loss_and_grads(_batch(cfg), with_metrics=True)
    # capacity ceil(0.5 * 16 * 2 / 4) = 4 of the 8 assignments an expert gets on average
    assert 0.4 < metrics["moe_dropped_fraction"] < 1.0


def test_full_remat_keeps_the_aux_loss_gradients():
    runs = {}
    for remat in ("none", "full"):
        cfg = _config(**{"model.remat": remat})
        state = build_train_state(cfg, None, jit_compile=False)
        runs[remat] = state.step.loss_and_grads(_batch(cfg)), [
            v.path for v in state.model.trainable_variables]
    (loss, grads), paths = runs["none"]
    (loss_full, grads_full), _ = runs["full"]
    np.testing.assert_allclose(loss_full, loss, rtol=LOSS_RTOL)
    for path, g, g_full in zip(paths, grads, grads_full):
        np.testing.assert_allclose(g_full, g, rtol=GRAD_RTOL,
                                   atol=1e-5 * float(np.abs(g).max()), err_msg=path)
    router = paths.index("llama/block_2/mlp/router/kernel")
    assert np.abs(grads[router]).max() > 0


def test_flops_count_the_active_parameters():
    moe = _config().model
    dense = dataclasses.replace(moe, num_experts=0)
    d, f, k, e, f_expert = 64, 128, 2, 4, 32
    # Each of the 2 sparse layers computes its router (D x E) and k experts (3 D x F')
    # per token instead of the dense MLP (3 D x F): 2 FLOPs per MAC, 3x forward.
    per_layer = d * e + k * 3 * d * f_expert - 3 * d * f
    assert flops_per_token(moe, 16) - flops_per_token(dense, 16) == 3 * 2 * 2 * per_layer


@pytest.mark.parametrize("overrides,message", [
    ({"model.family": "gpt"}, "mixtures of experts are llama-family models"),
    ({"model.num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds"),
    ({"model.moe_dispatch": "grouped", "model.moe_capacity_factor": 1.25},
     "model.moe_dispatch=grouped, which is dropless"),
    ({"model.mlp_only_layers": "[3]"}, r"\[3\] are not layers of this 3-layer model"),
])
def test_config_refuses_what_cannot_be_built(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(**overrides)


def test_lora_on_a_mixture_of_experts_is_accepted():
    # on its attention, and on its experts (tests/models/test_moe_lora.py)
    for targets in ("[q_proj,k_proj,v_proj,o_proj]", "[]", "[q_proj,up_proj]"):
        cfg = _config(**{"lora.rank": 4, "lora.targets": targets})
        assert cfg.lora.rank == 4


def test_mlp_only_layers_parse_as_integers():
    cfg = load_config(None, ["model.mlp_only_layers=[0, 2]"])
    assert cfg.model.mlp_only_layers == [0, 2]
    with pytest.raises(ConfigError, match="expected a list of integers"):
        load_config(None, ["model.mlp_only_layers=[a]"])


def test_experts_split_over_the_batch_axis_on_a_mesh():
    """Expert parallelism: the experts over the batch's axis (fsdp here), mlp over model;
    embed stays whole (fsdp is taken); the router replicated over its experts."""
    from tfllm.parallel import make_parallel
    cfg = _config(**{"mesh.axes": "fsdp=4,model=2"})
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    model = build_model(*sections(cfg), parallel=parallel, allocate=False)
    specs = {v.path: parallel.variable_spec(v) for v in model.variables}
    assert specs["llama/block_1/mlp/gate/kernel"] == ("fsdp", None, "model")
    assert specs["llama/block_1/mlp/down/kernel"] == ("fsdp", "model", None)
    assert specs["llama/block_1/mlp/router/kernel"] == ("fsdp", None)


def test_experts_stay_whole_when_the_rules_say_so():
    """`["experts", null]` first: every expert on every device, sharded as the dense MLP
    (embed over fsdp, mlp over model), and no expert parallelism to check."""
    import json

    from tfllm.parallel import make_parallel
    from tfllm.parallel.rules import DEFAULT_RULES, expert_axis
    rules = [["experts", None], ["activation_experts", None]] + [list(r) for r in DEFAULT_RULES]
    cfg = _config(**{"mesh.axes": "fsdp=4,model=2", "mesh.rules": json.dumps(rules)})
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    model = build_model(*sections(cfg), parallel=parallel, allocate=False)
    specs = {v.path: parallel.variable_spec(v) for v in model.variables}
    assert specs["llama/block_1/mlp/gate/kernel"] == (None, "fsdp", "model")
    assert specs["llama/block_1/mlp/down/kernel"] == (None, "model", "fsdp")
    assert expert_axis(cfg.model.num_experts, parallel.rules, parallel.shape) is None
    assert not any(parallel.expert_parallel(v) for v in model.variables)
