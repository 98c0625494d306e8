"""A mixture of experts under remat, gradient accumulation and DPO.

Remat (model.remat=selective / full) recomputes the same float32 ops: losses and gradients
within the parity harness's tolerances (tests/harness.py: LOSS_RTOL, GRAD_RTOL).

Gradient accumulation: the load-balancing loss E sum_e f_e P_e is a product of two batch
means, so it is not additive over micro-batches. tfllm adds router_aux_loss_coef x the
aux loss of each micro-batch's forward pass and averages over micro-batches, as
transformers does (the aux loss is part of each forward pass's loss; Trainer averages the
micro-batch losses) and as Megatron-LM scales its aux loss by 1/num_microbatches;
torchtitan refuses its batch-wise aux loss under gradient accumulation for exactly this
reason. So: without router terms an accumulated step equals the one-micro-batch step of
the same rows; with them, it equals the mean of each micro-batch's own step.

DPO adds the policy pass's aux loss, as TRL's DPOTrainer does with output_router_logits
(padding not counted: TRL passes the attention mask), and not the reference pass's.
"""

import io

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import GRAD_RTOL, LOSS_RTOL, tiny_config
from tfllm.data import SyntheticTokens, feed
from tfllm.models.common.moe import collecting_router_stats, load_balancing_loss
from tfllm.train.state import build_train_state

MOE = {"model.num_experts": 4, "model.num_experts_per_tok": 2,
       "model.moe_intermediate_dim": 32, "model.num_layers": 3,
       "model.mlp_only_layers": "[0]", "model.router_aux_loss_coef": 0.01}


def _state(**extra):
    cfg = tiny_config("llama", **{**MOE, **extra})
    return cfg, build_train_state(cfg, None, jit_compile=False)


def _rows(cfg, accum):
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=7)
    return data.batch(0, cfg.train.global_batch_size, accum)  # (A, M, T + 1)


def _assert_grads(got, want, paths):
    for path, g, w in zip(paths, got, want):
        # float32, the same ops summed in another order: the parity harness's tolerances
        np.testing.assert_allclose(g, w, rtol=GRAD_RTOL, atol=1e-5 * float(np.abs(w).max()),
                                   err_msg=path)


@pytest.mark.parametrize("remat", ["selective", "full"])
def test_remat_keeps_the_loss_the_aux_loss_and_their_gradients(remat):
    cfg, state = _state(**{"model.router_z_loss_coef": 0.1})
    _, with_remat = _state(**{"model.remat": remat, "model.router_z_loss_coef": 0.1})
    batch = feed.to_device(None, _rows(cfg, 1))
    loss, grads, metrics = state.step.loss_and_grads(batch, with_metrics=True)
    loss_r, grads_r, metrics_r = with_remat.step.loss_and_grads(batch, with_metrics=True)
    np.testing.assert_allclose(loss_r, loss, rtol=LOSS_RTOL)
    for name in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):
        np.testing.assert_allclose(metrics_r[name], metrics[name], rtol=LOSS_RTOL)
    paths = [v.path for v in state.step.variables]
    _assert_grads(grads_r, grads, paths)
    router = paths.index("llama/block_1/mlp/router/kernel")
    assert np.abs(grads_r[router]).max() > 0


def test_accumulation_without_router_terms_equals_one_micro_batch():
    no_aux = {"model.router_aux_loss_coef": 0.0}
    cfg, one = _state(**no_aux)
    _, two = _state(**no_aux, **{"train.grad_accum_steps": 2})
    loss1, grads1 = one.step.loss_and_grads(feed.to_device(None, _rows(cfg, 1)))
    loss2, grads2 = two.step.loss_and_grads(feed.to_device(None, _rows(cfg, 2)))
    np.testing.assert_allclose(loss2, loss1, rtol=LOSS_RTOL)
    _assert_grads(grads2, grads1, [v.path for v in one.step.variables])


def test_accumulation_averages_each_micro_batch_s_aux_loss():
    cfg, two = _state(**{"train.grad_accum_steps": 2})
    _, half = _state(**{"train.global_batch_size": 8})  # one micro-batch of 8 rows
    rows = _rows(cfg, 2)  # (2, 8, T + 1)
    loss, grads, metrics = two.step.loss_and_grads(feed.to_device(None, rows),
                                                   with_metrics=True)
    parts = [half.step.loss_and_grads(feed.to_device(None, rows[i:i + 1]), with_metrics=True)
             for i in range(2)]
    np.testing.assert_allclose(loss, np.mean([p[0] for p in parts]), rtol=LOSS_RTOL)
    np.testing.assert_allclose(metrics["moe_aux_loss"],
                               np.mean([p[2]["moe_aux_loss"] for p in parts]), rtol=LOSS_RTOL)
    mean_grads = [(a + b) / 2 for a, b in zip(parts[0][1], parts[1][1])]
    _assert_grads(grads, mean_grads, [v.path for v in two.step.variables])
    # ... which is not the aux loss of the 16 rows at once (a product of batch means)
    _, whole = _state()
    _, _, whole_metrics = whole.step.loss_and_grads(
        feed.to_device(None, rows.reshape(1, 16, -1)), with_metrics=True)
    assert whole_metrics["moe_aux_loss"] != metrics["moe_aux_loss"]


def test_the_step_reports_each_expert_s_tokens_summed_over_its_micro_batches():
    """moe_expert_tokens: per sparse layer (the 2 of 3 that are sparse) and expert, the
    step's assignments, summed over micro-batches (not averaged as the other metrics):
    16 rows x 16 tokens x k = 2 choices per layer, whatever the accumulation."""
    cfg, two = _state(**{"train.grad_accum_steps": 2})
    rows = _rows(cfg, 2)
    _, _, metrics = two.step.loss_and_grads(feed.to_device(None, rows), with_metrics=True)
    counts = np.array(metrics["moe_expert_tokens"])
    assert counts.shape == (2, 4) and counts.dtype.kind == "i"
    assert (counts.sum(axis=1) == 16 * cfg.data.sequence_length * 2).all()
    # the layer's imbalance metric is read off the same counts (averaged over the two
    # micro-batches, so at most the step's worst layer's max over mean)
    assert metrics["moe_load_imbalance"] >= 1.0
    _, one = _state()
    _, _, whole = one.step.loss_and_grads(feed.to_device(None, rows.reshape(1, 16, -1)),
                                          with_metrics=True)
    np.testing.assert_array_equal(whole["moe_expert_tokens"], counts)  # same rows, same choices


def test_padding_is_routed_but_not_counted():
    cfg, state = _state()
    model = state.model
    tokens = _rows(cfg, 1)[0][:4, :-1]
    segments = np.ones_like(tokens)
    segments[:, 10:] = 0  # the last 6 positions are padding
    with collecting_router_stats() as padded:
        model(tf.constant(tokens), segment_ids=tf.constant(segments))
    assert float(padded[0].num_tokens) == 4 * 10
    assert float(tf.reduce_sum(padded[0].expert_counts)) == 4 * 10 * 2  # k = 2 each


def test_dpo_adds_the_policy_pass_s_aux_loss():
    from tests.train.dpo_cases import DPO, pair_batch, randomize_adapters
    from tfllm.train.step import lm_forward
    extra = {**DPO, "train.global_batch_size": 2, "lora.targets": "[q_proj,v_proj]"}
    states = {}
    for coef in (0.0, 0.5):
        cfg = tiny_config("llama", **{**MOE, **extra, "model.router_aux_loss_coef": coef})
        states[coef] = build_train_state(cfg, None, False, packing_mask=True).step
        randomize_adapters(states[coef].model)  # the same seed: the same adapters
    tokens, segments, mask = pair_batch(np.random.default_rng(0), 2, 128)
    batch = feed.to_device(None, tokens[None], segments[None], mask[None])
    base, _, base_metrics = states[0.0].loss_and_grads(batch, with_metrics=True)
    loss, _, metrics = states[0.5].loss_and_grads(batch, with_metrics=True)
    with collecting_router_stats() as stats:  # the policy pass over both halves
        lm_forward(states[0.5].model, batch[0], True)
    aux = float(load_balancing_loss(stats))
    assert aux > 1.0  # random routing is not balanced
    np.testing.assert_allclose(metrics["moe_aux_loss"], aux, rtol=1e-6)
    np.testing.assert_allclose(base_metrics["moe_aux_loss"], aux, rtol=1e-6)  # reported
    # float32, the same terms: rounding only
    np.testing.assert_allclose(loss, base + 0.5 * aux, rtol=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(base_metrics["rewards/margins"])


def test_a_dpo_run_of_a_mixture_of_experts_evaluates_held_out_pairs(tmp_path):
    """Held-out pairs are scored with the router's scalar metrics (eval_moe_aux_loss);
    the step's per-expert counts are logged at its steps, not averaged into an
    evaluation."""
    import os
    from tests.harness import ROOT, metrics_records
    from tests.train.dpo_cases import DPO
    from tfllm.train.loop import train
    cfg = tiny_config("llama", **{
        **MOE, **DPO, "data.tokenizer": "byte", "model.vocab_size": 257,
        "data.chat_template": os.path.join(ROOT, "tfllm", "data", "templates",
                                           "chatml.jinja"),
        "data.sequence_length": 192, "model.max_sequence_length": 192,
        "data.validation_fraction": 0.2, "train.global_batch_size": 2, "train.steps": 2,
        "train.log_every": 1, "train.eval_every": 2, "train.eval_steps": 1,
        "lora.rank": 4, "lora.targets": "[q_proj,v_proj]"})
    train(cfg, str(tmp_path / "run"), out=io.StringIO())
    records = metrics_records(tmp_path / "run")
    steps = [r for r in records if "rewards/chosen" in r]
    assert len(steps) == 2 and all(np.array(r["moe_expert_tokens"]).shape == (2, 4)
                                   for r in steps)
    evals = [r for r in records if "eval_loss" in r]
    assert evals and all(r["eval_moe_aux_loss"] >= 1.0 for r in evals)
    assert not any("eval_moe_expert_tokens" in r for r in evals)


@pytest.mark.parametrize("targets", [
    "[q_proj,k_proj,v_proj,o_proj]",
    # the experts too (peft's target_parameters form: tests/models/test_moe_lora.py)
    "[q_proj,v_proj,experts.gate_up_proj,experts.down_proj]"], ids=["attention", "experts"])
def test_chat_sft_with_lora_trains_a_mixture_of_experts(tmp_path, targets):
    """Conversations (the chat example, ChatML, loss on the assistant turns) through an MoE
    model with LoRA on q/k/v/o, or on the experts too: the masked loss plus the aux loss
    goes down, the router metrics are reported, and only the adapters move."""
    from tests.data.datasets import CHATML, EXAMPLE
    from tfllm.train.loop import Run
    cfg = tiny_config("llama", **{
        **MOE, "data.source": "text", "data.format": "messages", "data.paths": f"[{EXAMPLE}]",
        "data.tokenizer": "byte", "data.chat_template": CHATML, "model.vocab_size": 257,
        "data.sequence_length": 256, "model.max_sequence_length": 256,
        "train.loss_on": "assistant", "train.global_batch_size": 4, "train.steps": 6,
        "lora.rank": 8, "lora.targets": targets, "optimizer.learning_rate": 3e-2})
    run = Run(cfg)
    frozen = {v.path: v.numpy().copy() for v in run.model.variables if "lora_" not in v.path}
    outs = [run.step(run.feed.train_batch(i)) for i in range(6)]
    losses = [float(o["loss"]) for o in outs]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert all(o["moe_aux_loss"] >= 1.0 for o in outs)  # 1 exactly when balanced
    assert all("lora_" in v.path for v in run.model.trainable_variables)
    for v in run.model.variables:
        if v.path in frozen:  # the experts, the router and the base attention stay
            np.testing.assert_array_equal(v.numpy(), frozen[v.path], err_msg=v.path)
