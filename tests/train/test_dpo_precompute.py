"""dpo.precompute_reference: the reference log-probs computed once before training and
stored with the run give the live reference's numbers (LoRA and full fine-tuning, one
device and a mesh of 8), a resumed run reads them back exactly, changed data is refused
in one line, and full fine-tuning keeps (and plans) no frozen copy. TRL's
precompute_ref_log_probs: tests/train/test_dpo_trl.py."""

import json
import math
import os
import shutil

import numpy as np
import pytest

from tests.harness import metrics_records, tiny_config
from tests.train.dpo_cases import DPO, ROOT, randomize_adapters

CHATML = os.path.join(ROOT, "tfllm", "data", "templates", "chatml.jinja")
EXAMPLE = os.path.join(ROOT, "tfllm", "data", "preference_example.jsonl")
#: the example pairs, byte-tokenized through ChatML (a vocabulary padded to divide over
#: model=2 and fsdp=2)
BYTES = {**DPO, "data.tokenizer": "byte", "model.vocab_size": 264,  # 257 ids, 8 | 264
         "data.chat_template": CHATML, "data.sequence_length": 192,
         "model.max_sequence_length": 192}


def _config(axes="data=1", **extra):
    return tiny_config("llama", axes, **{**BYTES, **extra})


def test_orpo_has_no_reference_to_precompute():
    from tfllm.config.loader import ConfigError
    with pytest.raises(ConfigError, match="ORPO has no reference model to precompute"):
        _config(**{"dpo.loss": "orpo", "lora.rank": 0, "dpo.precompute_reference": True})


def test_full_fine_tuning_with_stored_references_keeps_and_plans_no_copy():
    """No frozen copy is built, and tfllm plan's estimate (tfllm.footprint.fit) holds the
    state of SFT: the weights and AdamW's moments, no reference weights."""
    from tfllm.footprint import fit
    from tfllm.train.state import build_train_state
    sft = tiny_config("llama", **{"train.global_batch_size": 4})
    full = {**DPO, "train.global_batch_size": 4, "lora.rank": 0}
    copy = tiny_config("llama", **full)
    stored = tiny_config("llama", **{**full, "dpo.precompute_reference": True})
    assert build_train_state(stored, None, False, optimizer=False).reference is None
    assert fit.estimate(stored, 1).state == fit.estimate(sft, 1).state
    weights = fit.estimate(sft, 1).state // 3  # float32 weights and two AdamW moments
    assert fit.estimate(copy, 1).state == fit.estimate(stored, 1).state + weights


@pytest.mark.parametrize("axes,accum,rank", [
    ("data=1", 1, 4),
    ("data=1", 1, 0),
    # 8 logical devices, pairs over data with two micro-batches (the pass's row-to-pair
    # bookkeeping over micro-batches and devices), with LoRA; ~1.5 min: marked slow. The
    # full fine-tuning case ran here too (110 s of CI): which reference the stored
    # log-probs replace is the one-device cases' difference, the mesh bookkeeping the same.
    pytest.param("data=2,fsdp=2,model=2", 2, 4, marks=pytest.mark.slow),
])
def test_stored_references_give_the_live_reference_s_loss_metrics_and_gradients(
        axes, accum, rank, tmp_path):
    """The same run twice, with dpo.precompute_reference and without: the reference pass
    over every training and held-out pair, then (full fine-tuning) one update, then the
    step's loss, TRL's metrics and the gradients of a shuffled training batch, and the
    held-out evaluation, equal the live reference's (the adapters-off model; full
    fine-tuning's frozen copy of the first weights)."""
    from tfllm.train import reference
    from tfllm.train.run import Run
    out = []
    for precompute in (False, True):
        config = _config(axes, **{
            "lora.rank": rank, "dpo.precompute_reference": precompute,
            "train.global_batch_size": 4, "train.grad_accum_steps": accum,
            "data.validation_fraction": 0.25, "train.eval_steps": 4})
        run = Run(config, workdir=str(tmp_path / str(precompute)))
        if rank:
            randomize_adapters(run.model, parallel=run.parallel)
        assert (run.reference is None) == (rank > 0 or precompute)
        if precompute:
            stored = reference.compute(run, str(tmp_path))
            run.feed.references = stored.tables
            assert sorted(stored.tables) == ["train", "validation"]
            assert "precomputed in one forward pass" in stored.summary()
        if not rank:  # full fine-tuning: one update moves the policy off its reference
            run.step(run.feed.train_batch(0))
        out.append((run.step.loss_and_grads(run.feed.train_batch(1), with_metrics=True),
                    run.evaluate()))
    ((loss, grads, metrics), evals), ((s_loss, s_grads, s_metrics), s_evals) = out
    assert abs(metrics["rewards/margins"]) > 1e-4  # the policy is not its reference
    # The reference's log-probs come from another compiled program over other rows (the
    # pass reads the pairs in order, the step a shuffled batch): float32 rounding of sums
    # of ~100 token log-probs (~1e-6 relative each), so rel 1e-5 on the loss and
    # metrics; full fine-tuning's update divides by |g| (AdamW), so its rounding is
    # relative to lr = 1e-2 per weight, as in test_dpo.py
    assert s_loss == pytest.approx(loss, rel=1e-5)
    for key in metrics:
        assert s_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-5), key
    for key in evals:
        assert s_evals[key] == pytest.approx(evals[key], rel=1e-5, abs=1e-5), key
    # A gradient is sum_p w_p d(logps)/d(weights) with w_p = beta sigmoid'-scaled: a
    # reference sum of ~750 nats rounded differently (float32: ~1e-4) moves w_p by at most
    # beta (0.5) x 1/4 x 1e-4 ~ 1e-5 relative, on gradients up to ~0.6: so 1e-5 absolute
    # (measured: 1.4e-6 on an element of 8e-4); a wrong reference moves w_p by O(1)
    for g, g0 in zip(s_grads, grads):
        np.testing.assert_allclose(g, g0, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # three short runs and an evaluation of a tiny model
def test_a_resumed_run_reads_its_references_back_and_refuses_changed_data(tmp_path,
                                                                          capsys):
    """Full fine-tuning with stored references: 3 steps then a resume to 6 log the
    straight run's losses and rewards exactly; `tfllm eval` reads the held-out values
    back (the run's final numbers); a data file changed since is refused in one line,
    the run left as it was."""
    from tfllm.cli.main import main
    from tfllm.data.errors import DataError
    from tfllm.train.loop import train
    data = tmp_path / "pairs.jsonl"
    shutil.copy(EXAMPLE, data)
    overrides = {
        "lora.rank": 0, "dpo.precompute_reference": True, "data.paths": f"[{data}]",
        "data.validation_fraction": 0.2, "train.eval_every": 3, "train.eval_steps": 8,
        "train.global_batch_size": 2, "train.log_every": 1, "checkpoint.every": 3,
        "optimizer.learning_rate": 1e-3,
        # a schedule that does not depend on train.steps, which the two runs change
        "optimizer.warmup_steps": 0, "optimizer.decay_steps": 100}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(_config(**{**overrides, "train.steps": 6}), str(straight))
    train(_config(**{**overrides, "train.steps": 3}), str(resumed))
    assert "precomputed in one forward pass" in capsys.readouterr().out
    train(_config(**{**overrides, "train.steps": 6}), str(resumed))
    assert "DPO reference: log-probabilities of " in capsys.readouterr().out
    stored = json.loads((resumed / "reference_logps.json").read_text())
    assert stored == json.loads((straight / "reference_logps.json").read_text())
    assert not os.path.exists(resumed / "checkpoints" / "reference")
    want, got = metrics_records(straight), metrics_records(resumed)
    keys = ("loss", "rewards/margins", "logps/chosen")
    assert [[r[k] for k in keys] for r in got if "loss" in r] == [
        [r[k] for k in keys] for r in want if "loss" in r]
    evals = [r for r in got if "eval_loss" in r]
    assert [r["eval_loss"] for r in evals] == [
        r["eval_loss"] for r in want if "eval_loss" in r]
    assert not math.isclose(evals[0]["eval_rewards/margins"], 0.0)
    # tfllm eval: the stored held-out values with the trained weights, the run's numbers
    capsys.readouterr()
    assert main(["eval", "--workdir", str(resumed), "--steps", "8"]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert evaluated[key] == pytest.approx(evals[-1][key], rel=1e-6), key
    # A changed reply: the pairs differ from those the values were computed for
    lines = data.read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace("Paris.", "Paris, on the Seine.")
    data.write_text("".join(lines))
    before = sorted(os.listdir(resumed)), (resumed / "metrics.jsonl").read_text()
    with pytest.raises(DataError) as refused:
        train(_config(**{**overrides, "train.steps": 9}), str(resumed))
    message = str(refused.value)
    assert "\n" not in message and "pairs changed since the run started" in message
    assert str(resumed / "reference_logps.json") in message
    assert (sorted(os.listdir(resumed)), (resumed / "metrics.jsonl").read_text()) == before
