"""The user's path of chat fine-tuning with LoRA, end to end through the CLI:
`tfllm import --config configs/recipes/sft-lora.yaml`, `tfllm train`, `tfllm export
--format peft`; peft loads the adapter onto the transformers base and computes the
trained run's logits."""

import json
import os

import numpy as np
import pytest

from tests.cli.chat_runs import EXAMPLE, ROOT, imported_llama
from tests.pretrained import helpers
from tests.pretrained import transformers_reference as ref
from tfllm.cli.main import main

RECIPE = os.path.join(ROOT, "configs", "recipes", "sft-lora.yaml")


@pytest.mark.slow  # imports, trains 6 steps with evaluation and a sample, exports: ~60 s
def test_the_sft_lora_recipe_trains_adapters_that_peft_serves(tmp_path, capsys):
    import peft

    from tfllm.checkpoint.reader import Reader
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.config import load_config
    from tfllm.models import build_model

    chats = tmp_path / "chats.jsonl"  # see test_chat_cli: no tool schemas at 256 tokens
    chats.write_text("".join(line for line in open(EXAMPLE) if '"tools"' not in line))
    tiny = {"model.max_sequence_length": 256, "data.sequence_length": 256,
            "data.paths": f"[{chats}]", "train.global_batch_size": 4, "train.steps": 6,
            "train.eval_every": 3, "train.eval_steps": 2, "train.sample_tokens": 8,
            "lora.rank": 8, "mesh.axes": "data=2",
            # large steps at once, so that 6 steps move the logits visibly
            "optimizer.warmup_steps": 1, "optimizer.learning_rate": 1e-2}
    config = imported_llama(tmp_path, "--config", RECIPE,
                            *[a for k, v in tiny.items() for a in ("--set", f"{k}={v}")])
    assert (config.data.format, config.train.loss_on, config.lora.rank) == (
        "messages", "assistant", 8)
    run = str(tmp_path / "run")
    capsys.readouterr()
    assert main(["train", "--workdir", run]) == 0
    out = capsys.readouterr().out
    assert "tfllm: LoRA rank 8 (alpha 32, scale 4) on 14 projections" in out
    assert "sample: user: In one sentence" in out and "\nassistant: " in out
    with open(os.path.join(run, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval_accuracy" in r]
    assert len(evals) == 2 and all(r["eval_tokens"] > 0 for r in evals)

    # Only the adapters moved: every base weight is the imported one, bit for bit.
    run_dir = Workdir(run)
    first, last = (Reader(p) for p in (dict(run_dir.committed())[0],
                                        run_dir.latest_checkpoint()))
    moved = [n for n in first.variables if n.startswith("model/")
             and not np.array_equal(first.whole(n), last.whole(n))]
    assert moved and all(n.endswith(("/lora_a", "/lora_b")) for n in moved), moved
    assert sum(n.endswith("/lora_b") for n in moved) == 14  # each adapter's B left zero

    assert main(["export", "--workdir", run, "--out", str(tmp_path / "adapter"),
                 "--format", "peft"]) == 0
    trained = load_config(os.path.join(run, "config.yaml"))
    model = build_model(trained.model, trained.precision, trained.lora, seed=trained.train.seed)
    run_dir.restore_weights(model)
    ids = helpers.token_ids(length=24)
    ours = np.asarray(model(ids), np.float32)
    served = peft.PeftModel.from_pretrained(ref.load(tmp_path / "hf"),
                                            str(tmp_path / "adapter")).eval()
    ref.assert_same_model(ours, ref.logits(served, ids))
    # the adapter changed the model (B left zero would pass the comparison above too)
    base = ref.logits(ref.load(tmp_path / "hf"), ids)
    assert np.abs(ours - base).max() > 1e-2 * np.abs(base).max()
