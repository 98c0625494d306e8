"""The user's path of preference tuning with LoRA, end to end through the CLI:
`tfllm import --config configs/recipes/dpo-lora.yaml`, `tfllm train`, `tfllm export
--format peft`; TRL's DPOTrainer evaluates the exported adapter on the run's held-out
pairs (reference: the base) and gets the eval loss and rewards the run logged."""

import json
import os

import numpy as np
import pytest

from tests.cli.chat_runs import ROOT, imported_llama
from tests.pretrained import transformers_reference as ref
from tfllm.cli.main import main

RECIPE = os.path.join(ROOT, "configs", "recipes", "dpo-lora.yaml")


@pytest.mark.slow  # imports, trains 8 steps with evaluations, exports, runs TRL: ~60 s
def test_the_dpo_lora_recipe_trains_adapters_trl_evaluates_alike(tmp_path, capsys):
    import datasets
    import peft
    import trl
    from transformers import AutoTokenizer

    from tfllm.checkpoint.reader import Reader
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.config import load_config
    from tfllm.data.sources import split_records

    tiny = {"model.max_sequence_length": 256, "data.sequence_length": 255,
            "train.global_batch_size": 4, "train.steps": 8, "train.log_every": 1,
            "train.eval_every": 4, "train.eval_steps": 8, "lora.rank": 8,
            "mesh.axes": "data=2", "dpo.beta": 0.5,
            # large steps, so that 8 steps move the rewards visibly
            "optimizer.warmup_steps": 1, "optimizer.learning_rate": 1e-2}
    config = imported_llama(tmp_path, "--config", RECIPE,
                            *[a for k, v in tiny.items() for a in ("--set", f"{k}={v}")])
    assert (config.data.format, config.train.objective, config.dpo.loss) == (
        "preference", "dpo", "sigmoid")
    run = str(tmp_path / "run")
    assert main(["train", "--workdir", run]) == 0
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "rewards/accuracies" in r]
    assert len(steps) == 8 and steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    evals = [r for r in records if "eval_rewards/accuracies" in r]
    assert [r["step"] for r in evals] == [4, 8]

    # Only the adapters moved: every base weight is the imported one, bit for bit.
    run_dir = Workdir(run)
    first, last = (Reader(p) for p in (dict(run_dir.committed())[0],
                                        run_dir.latest_checkpoint()))
    moved = [n for n in first.variables if n.startswith("model/")
             and not np.array_equal(first.whole(n), last.whole(n))]
    assert moved and all(n.endswith(("/lora_a", "/lora_b")) for n in moved), moved

    # tfllm eval gives the numbers the run logged at its end
    capsys.readouterr()
    assert main(["eval", "--workdir", run, "--steps", "8"]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("eval_loss", "eval_rewards/accuracies", "eval_logps/rejected"):
        assert evaluated[key] == pytest.approx(evals[-1][key], rel=1e-6), key

    # TRL evaluates the exported adapter on the held-out pairs, the base as reference.
    assert main(["export", "--workdir", run, "--out", str(tmp_path / "adapter"),
                 "--format", "peft"]) == 0
    trained = load_config(os.path.join(run, "config.yaml"))
    held_out = [json.loads(r.text) for r in split_records(trained.data, "validation")]
    policy = peft.PeftModel.from_pretrained(ref.load(tmp_path / "hf"),
                                            str(tmp_path / "adapter"))
    # bf16=False: DPOConfig's default bf16 autocast moves log-probs by ~1e-2
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True,
                         bf16=False, beta=0.5, max_length=256,
                         per_device_eval_batch_size=len(held_out))
    trainer = trl.DPOTrainer(model=policy, ref_model=ref.load(tmp_path / "hf"), args=args,
                             train_dataset=datasets.Dataset.from_list(held_out),
                             eval_dataset=datasets.Dataset.from_list(held_out),
                             processing_class=AutoTokenizer.from_pretrained(
                                 str(tmp_path / "hf")))
    theirs, ours = trainer.evaluate(), evals[-1]
    assert ours["eval_pairs"] == len(held_out) > 0
    # float32 on both sides; log-probs are sums of ~20 tokens (tests/train/test_dpo_trl.py)
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
                "logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(ours[f"eval_{key}"], theirs[f"eval_{key}"], rtol=1e-5,
                                   atol=1e-4, err_msg=key)
    # a fraction of pairs, k / n: TRL's is rounded to float32
    assert ours["eval_rewards/accuracies"] == pytest.approx(
        theirs["eval_rewards/accuracies"], abs=1e-7)
    assert abs(ours["eval_rewards/margins"]) > 1e-3  # the adapter moved the policy
