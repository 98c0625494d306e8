"""DPO in the step: one forward pass for both halves of a pair, the reference is the model
with its adapters off and takes no gradient, the loss of accumulated micro-batches and of
a mesh is one device's. TRL's numbers: tests/train/test_dpo_trl.py."""

import json
import math
import os

import numpy as np
import pytest

from tests.harness import sections, tiny_config
from tests.train.dpo_cases import DPO, ROOT, pair_batch, randomize_adapters
from tfllm.data import feed

def test_a_fresh_adapter_is_its_reference_and_the_reference_takes_no_gradient():
    """With B = 0 the policy is the adapters-off model: rewards 0 and the sigmoid loss
    log 2. With B random, the step's gradients are those of the loss with the reference
    log-probabilities computed apart (adapters off) and held constant."""
    import tensorflow as tf

    from tfllm.models.common.adapters import adapters_off
    from tfllm.train.dpo import pairs_of, row_sums
    from tfllm.train.state import build_train_state
    from tfllm.train.step import lm_forward
    cfg = tiny_config("llama", **{"train.global_batch_size": 2}, **DPO)
    step = build_train_state(cfg, None, False, packing_mask=True).step
    assert all("lora_" in v.path for v in step.variables)  # only adapters train
    tokens, segments, mask = pair_batch(np.random.default_rng(0), 2, 128)
    batch = feed.to_device(None, tokens[None], segments[None], mask[None])
    out = step.compiled(batch, tf.constant(np.inf, tf.float32))
    # one forward of the same weights twice: the same float32 numbers, so exactly 0
    assert float(out["rewards/chosen"]) == 0 and float(out["rewards/margins"]) == 0
    assert float(out["loss"]) == pytest.approx(math.log(2), abs=1e-7)
    assert float(out["step_ok"]) == 1

    randomize_adapters(step.model)
    loss, grads = step.loss_and_grads(batch)
    micro = batch[0]
    trained = tf.cast(micro[2][:, 1:], tf.float32)
    with adapters_off():
        ref_logits, targets, _ = lm_forward(step.model, micro, True)
    ref_c, ref_r = (tf.constant(x.numpy()) for x in pairs_of(row_sums(ref_logits, targets,
                                                                      trained)[0]))
    with tf.GradientTape() as tape:
        logits, _, _ = lm_forward(step.model, micro, True)
        c, r = pairs_of(row_sums(logits, targets, trained)[0])
        want = tf.reduce_mean(-tf.math.log_sigmoid(0.5 * ((c - ref_c) - (r - ref_r))))
    want_grads = tape.gradient(want, step.variables)
    assert loss == pytest.approx(float(want), rel=1e-6)  # the same ops: rounding only
    assert abs(loss - math.log(2)) > 1e-3  # the adapters moved the policy
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-7)  # rounding only


@pytest.mark.parametrize("mesh,accum,rpo,rank,loss", [
    (None, 2, 0.0, 4, "ipo"),
    ("data=2", 2, 0.3, 4, "ipo"),
    # pairs over FSDP with tensor parallelism (~15-20 s each: compiles a mesh), LoRA and
    # full fine-tuning (its frozen reference copy sharded as the model)
    pytest.param("fsdp=2,model=2", 1, 0.3, 4, "ipo", marks=pytest.mark.slow),
    pytest.param("fsdp=2,model=2", 2, 0.3, 0, "ipo", marks=pytest.mark.slow),
    pytest.param("data=2,fsdp=2", 1, 0.0, 0, "ipo", marks=pytest.mark.slow),
    # ORPO: no reference at all; its NLL is a mean over each micro-batch, so one
    # micro-batch on both sides
    pytest.param("data=2", 1, 0.0, 0, "orpo", marks=pytest.mark.slow),
])
def test_accumulated_and_sharded_steps_equal_one_device(mesh, accum, rpo, rank, loss):
    """Four pairs (IPO, with RPO on the meshes; ORPO once): 2 micro-batches give one
    micro-batch's loss, metrics and gradients (pair losses are means over pairs); a mesh
    whose batch axis splits the rows (each device holds whole pairs) gives one device's
    with the same micro-batches (the RPO and ORPO NLL terms are means over each
    micro-batch's tokens, as TRL's under gradient accumulation, so only the mesh cases
    compare them)."""
    from tfllm.parallel import make_parallel
    from tfllm.train.state import build_train_state
    tokens, segments, mask = pair_batch(np.random.default_rng(3), 4, 128)
    out = []
    for axes, a in ((None, 1 if mesh is None else accum), (mesh, accum)):
        cfg = tiny_config("llama", axes or "data=1", **{
            **DPO, "train.global_batch_size": 4, "train.grad_accum_steps": a,
            "dpo.loss": loss, "dpo.rpo_alpha": rpo, "lora.rank": rank})
        parallel = None if axes is None else make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
        state = build_train_state(cfg, parallel, False, packing_mask=True)
        step = state.step
        assert (state.reference is None) == (rank > 0 or loss == "orpo")
        shape = (a, 8 // a, 17)
        batch = feed.to_device(parallel, tokens.reshape(shape), segments.reshape(shape),
                               mask.reshape(shape))
        if rank:
            randomize_adapters(step.model, parallel=parallel)
        else:  # full fine-tuning: one update moves the policy from its reference copy
            step(batch)
        out.append(step.loss_and_grads(batch, with_metrics=True))
    (loss, grads, metrics), (other_loss, other_grads, other_metrics) = out
    # float32 reduction order only; with full fine-tuning after one AdamW update whose
    # gradients already differed by that rounding (the update divides by |g|, so its
    # rounding is relative to lr = 1e-2 per weight): 1.3e-6 measured on data=2,fsdp=2
    assert other_loss == pytest.approx(loss, rel=1e-6 if rank else 1e-5)
    for key in metrics:
        assert other_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    # IPO's gradient scales with (delta' - 1/(2 beta)), where delta' differs sequence
    # log-probs of ~40 summed in another order (float32: ~3e-6 absolute): elements of
    # gradients up to ~0.15 move by up to ~4e-7 (measured), so 1e-6 absolute.
    for g, g0 in zip(other_grads, grads):
        np.testing.assert_allclose(g, g0, rtol=1e-5 if rank else 1e-4, atol=1e-6)


@pytest.mark.slow  # trains a run (~30 steps of a tiny model) with evaluations
def test_a_dpo_run_logs_trls_metrics_and_evaluates_held_out_pairs(tmp_path):
    """train() on the example pairs with a fresh adapter: metrics.jsonl carries TRL's
    names at every logged step, evaluations the held-out pairs' DPO loss and rewards; the
    first step starts at the reference (loss log 2, rewards 0) and training separates
    chosen from rejected on the pairs it trains on."""
    from tests.harness import metrics_records
    from tfllm.train.loop import train
    from tfllm.train.dpo import METRICS
    cfg = tiny_config("llama", **{
        **DPO, "data.tokenizer": "byte", "model.vocab_size": 257,
        "data.chat_template": os.path.join(ROOT, "tfllm", "data", "templates",
                                           "chatml.jinja"),
        "data.sequence_length": 192, "model.max_sequence_length": 192,
        "data.validation_fraction": 0.2, "train.global_batch_size": 4,
        "train.steps": 30, "train.log_every": 1, "train.eval_every": 15,
        "train.eval_steps": 8, "optimizer.learning_rate": 3e-3,
        "optimizer.warmup_steps": 0, "lora.rank": 8, "lora.alpha": 16.0})
    train(cfg, str(tmp_path / "run"))
    records = metrics_records(tmp_path / "run")
    steps = [r for r in records if "rewards/chosen" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    assert steps[0]["rewards/margins"] == 0
    for key in METRICS:
        assert all(math.isfinite(r[key]) for r in steps), key
    late = steps[-10:]
    assert np.mean([r["rewards/margins"] for r in late]) > 0.1
    assert np.mean([r["rewards/accuracies"] for r in late]) > 0.7
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [15, 30]
    for r in evals:
        assert r["eval_pairs"] > 0 and all(math.isfinite(r[f"eval_{k}"]) for k in METRICS)
    with open(tmp_path / "run" / "config.yaml") as f:
        assert "objective: dpo" in f.read()  # the resolved config names it


def test_full_fine_tuning_compares_with_a_frozen_copy_of_the_first_weights():
    """lora.rank=0: the reference is a frozen copy (built as the model, same seed: the
    same first weights), saved with the run; only the policy's weights train, and after
    an update the step's gradients are those with the copy's log-probs held constant."""
    import tensorflow as tf

    from tfllm.train.dpo import pairs_of, row_sums
    from tfllm.train.run import run_state_variables
    from tfllm.train.state import build_train_state
    from tfllm.train.step import lm_forward
    cfg = tiny_config("llama", **{**DPO, "lora.rank": 0, "train.global_batch_size": 2})
    state = build_train_state(cfg, None, False, packing_mask=True)
    step, reference = state.step, state.reference
    assert reference is not None and not reference.trainable_variables
    assert len(step.variables) == len(reference.variables)  # every policy weight trains
    names = run_state_variables(state.model, state.optimizer, None, None, reference)
    assert sum(n.startswith("reference/") for n in names) == len(reference.variables)
    tokens, segments, mask = pair_batch(np.random.default_rng(4), 2, 128)
    batch = feed.to_device(None, tokens[None], segments[None], mask[None])
    first = step.compiled(batch, tf.constant(np.inf, tf.float32))
    assert float(first["loss"]) == pytest.approx(math.log(2), abs=1e-7)  # policy = copy
    loss, grads = step.loss_and_grads(batch)  # after one update of the policy only
    assert abs(loss - math.log(2)) > 1e-4
    micro = batch[0]
    trained = tf.cast(micro[2][:, 1:], tf.float32)
    ref_logits, targets, _ = lm_forward(reference, micro, True)
    ref_c, ref_r = (tf.constant(x.numpy()) for x in pairs_of(row_sums(ref_logits, targets,
                                                                      trained)[0]))
    with tf.GradientTape() as tape:
        logits, _, _ = lm_forward(step.model, micro, True)
        c, r = pairs_of(row_sums(logits, targets, trained)[0])
        want = tf.reduce_mean(-tf.math.log_sigmoid(0.5 * ((c - ref_c) - (r - ref_r))))
    assert loss == pytest.approx(float(want), rel=1e-6)  # the same ops: rounding only
    for g, w in zip(grads, tape.gradient(want, step.variables)):
        np.testing.assert_allclose(g, tf.convert_to_tensor(w).numpy(), rtol=1e-5,
                                   atol=1e-7)  # rounding only


@pytest.mark.slow  # three short runs of a tiny model
def test_full_fine_tuning_saves_its_reference_and_resumes_exactly(tmp_path, capsys):
    """lora.rank=0: checkpoints hold the reference copy (the first weights, unchanged by
    training); 3 steps then a resume to 6 log the losses and rewards of 6 steps at once."""
    from tests.harness import metrics_records
    from tfllm.checkpoint.reader import Reader
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.cli.main import main
    from tfllm.models import build_model
    from tfllm.train.loop import train
    overrides = {
        **DPO, "lora.rank": 0, "data.tokenizer": "byte", "model.vocab_size": 257,
        "data.chat_template": os.path.join(ROOT, "tfllm", "data", "templates",
                                           "chatml.jinja"),
        "data.sequence_length": 192, "model.max_sequence_length": 192,
        "data.validation_fraction": 0.2, "train.eval_every": 0, "train.eval_steps": 8,
        "train.global_batch_size": 2,
        "train.log_every": 1, "checkpoint.every": 3, "optimizer.learning_rate": 1e-3,
        # a schedule that does not depend on train.steps, which the two runs change
        "optimizer.warmup_steps": 0, "optimizer.decay_steps": 100}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_config("llama", **{**overrides, "train.steps": 6}), str(straight))
    train(tiny_config("llama", **{**overrides, "train.steps": 3}), str(resumed))
    train(tiny_config("llama", **{**overrides, "train.steps": 6}), str(resumed))
    want, got = metrics_records(straight), metrics_records(resumed)
    keys = ("loss", "rewards/margins", "logps/chosen")
    assert [[r[k] for k in keys] for r in got if "loss" in r] == [
        [r[k] for k in keys] for r in want if "loss" in r]
    # tfllm eval restores the reference copy from the checkpoint: the run's final numbers
    final = [r for r in got if "eval_loss" in r][-1]
    capsys.readouterr()
    assert main(["eval", "--workdir", str(resumed), "--steps", "8"]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert evaluated[key] == pytest.approx(final[key], rel=1e-6), key
    first = build_model(*sections(tiny_config("llama", **{**overrides, "train.steps": 6})))
    saved = Reader(Workdir(str(resumed)).latest_checkpoint())
    moved = 0
    for v in first.variables:
        np.testing.assert_array_equal(saved.whole(f"reference/{v.path}"), v.numpy())
        moved += not np.array_equal(saved.whole(f"model/{v.path}"), v.numpy())
    assert moved == len(first.variables)  # the policy trained, the reference did not


def test_the_progress_line_and_loss_png_show_reward_accuracy(tmp_path):
    """DPO records: the progress line names TRL's reward accuracy and margin, loss.png
    draws the train and validation reward accuracy beside the loss."""
    from tfllm.train.plots import plot_loss
    from tfllm.train.progress import Progress
    record = {"step": 3, "loss": 0.6, "rewards/accuracies": 0.75, "rewards/margins": 0.25,
              "eval_loss": 0.65, "eval_rewards/accuracies": 0.5}
    line = Progress(10, "lines").line(3, record, 100.0, 5.0)
    assert "acc 0.75" in line and "margin 0.250" in line and "val acc 0.50" in line
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({**record, "step": s}) + "\n" for s in (1, 2, 3)))
    plot_loss(str(metrics), str(tmp_path / "loss.png"))
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_the_memory_estimate_counts_pairs_as_two_rows_and_the_reference_copy():
    """tfllm.footprint.fit: a pair's two sequences in the activations; full fine-tuning's
    frozen reference copy in the state (LoRA's reference and ORPO cost no copy)."""
    from tfllm.footprint import fit
    sft = tiny_config("llama", **{"train.global_batch_size": 4})
    with_lora = tiny_config("llama", **{**DPO, "train.global_batch_size": 4})
    full = tiny_config("llama", **{**DPO, "train.global_batch_size": 4, "lora.rank": 0})
    orpo = tiny_config("llama", **{**DPO, "train.global_batch_size": 4, "lora.rank": 0,
                                   "dpo.loss": "orpo"})
    estimates = {name: fit.estimate(c, 1) for name, c in
                 (("sft", sft), ("full", full), ("orpo", orpo), ("lora", with_lora))}
    assert estimates["full"].activations == 2 * estimates["sft"].activations
    weights = estimates["sft"].state // 3  # float32 weights and AdamW's two moments
    assert estimates["full"].state == estimates["sft"].state + weights
    assert estimates["orpo"].state == estimates["sft"].state


def test_orpo_s_log_odds_are_finite_with_their_gradient_at_the_ends():
    """log(1 - exp(x)) for mean log-probabilities from -80 to 0: finite values and
    gradients (the branch not taken must not make 0 * inf = NaN), TRL's values inside."""
    import tensorflow as tf

    from tfllm.train.dpo import log1mexp
    x = tf.constant([-80.0, -5.0, -0.7, -0.69, -1e-3, -1e-9, 0.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = log1mexp(x)
        total = tf.reduce_sum(y)
    grad = tape.gradient(total, x).numpy()
    assert np.isfinite(y.numpy()).all() and np.isfinite(grad).all()
    inner = np.array([-80.0, -5.0, -0.7, -0.69, -1e-3], np.float64)
    # float32 against float64: relative rounding
    want = np.where(inner > -0.69, np.log(-np.expm1(inner)), np.log1p(-np.exp(inner)))
    np.testing.assert_allclose(y.numpy()[:5], want, rtol=1e-5)


@pytest.mark.slow  # compiles the step through XLA on a mesh
def test_the_xla_compiled_step_on_a_mesh_equals_one_device():
    """jit_compile on data=2 (XLA clusters per device, the pair reshape inside them)
    against one device without XLA: the same loss, metrics and gradients."""
    from tfllm.parallel import make_parallel
    from tfllm.train.state import build_train_state
    tokens, segments, mask = pair_batch(np.random.default_rng(5), 4, 128)
    out = []
    for axes, jit in ((None, False), ("data=2", True)):
        cfg = tiny_config("llama", axes or "data=1", **{**DPO, "train.global_batch_size": 4})
        parallel = None if axes is None else make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
        step = build_train_state(cfg, parallel, jit, packing_mask=True).step
        randomize_adapters(step.model, parallel=parallel)
        out.append(step.loss_and_grads(feed.to_device(
            parallel, tokens[None], segments[None], mask[None]), with_metrics=True))
    (loss, grads, metrics), (xla_loss, xla_grads, xla_metrics) = out
    # XLA fuses and reorders float32 sums: rounding only
    assert xla_loss == pytest.approx(loss, rel=1e-5)
    # A reward is beta * (policy - reference) log-probabilities, each a float32 sum of
    # magnitude |logps|: the difference keeps their rounding, a few ulps of |logps|
    # (ulp(25) = 1.9e-6; rewards/rejected once differed by 1.1e-6 under load).
    ulp = float(np.spacing(np.float32(max(abs(metrics["logps/chosen"]),
                                          abs(metrics["logps/rejected"])))))
    beta = tiny_config("llama", **DPO).dpo.beta
    for key in metrics:
        tol = 8 * beta * ulp if key.startswith("rewards/") else 1e-6
        assert xla_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=tol), key
    for g, g0 in zip(xla_grads, grads):
        np.testing.assert_allclose(g, g0, rtol=1e-4, atol=1e-6)
