"""The loss-spike guard and asynchronous checkpoint saves inside the training loop."""

import os

import pytest

from tests.harness import metrics_records, tiny_config
from tfllm.parallel.placement import to_numpy
from tfllm.train import loop


@pytest.mark.slow
def test_loss_spike_guard_skips_steps_above_the_limit(tmp_path, monkeypatch):
    # factor 0.5: once the 2-loss window is full every loss is a "spike" (no loss
    # halves in one step), so steps 3-6 are skipped and counted; steps 1-2 apply.
    cfg = tiny_config("gpt", "data=2,model=4", **{
        "train.steps": 6, "train.log_every": 1, "train.loss_spike_factor": 0.5,
        "train.loss_spike_window": 2, "train.eval_steps": 1})
    runs = []
    real_run = loop.Run
    monkeypatch.setattr(loop, "Run", lambda *a, **k: runs.append(real_run(*a, **k)) or runs[-1])
    loop.train(cfg, str(tmp_path))
    steps = [r for r in metrics_records(tmp_path) if "loss" in r]
    assert [r["skipped_steps"] for r in steps] == [0, 0, 1, 2, 3, 4]
    assert int(to_numpy(runs[0].optimizer.iterations)) == 2


@pytest.mark.slow
def test_async_checkpoints_commit_and_resume(tmp_path):
    cfg = tiny_config("gpt", "data=2,model=4", **{
        "train.steps": 6, "train.log_every": 1, "checkpoint.every": 2,
        "checkpoint.async_save": "true", "checkpoint.max_to_keep": 2,
        "train.eval_steps": 1})
    loop.train(cfg, str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000004", "step_00000006"]
    for name in os.listdir(tmp_path / "checkpoints"):
        assert (tmp_path / "checkpoints" / name / "COMMIT").exists()
