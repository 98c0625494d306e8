"""The main job: `tfllm train` with no config, shortened; and the progress display."""

import io
import math
import os

import pytest

from tfllm.train.metrics import Peak
from tfllm.train.progress import Progress
from tests.harness import metrics_records, run_tfllm


@pytest.mark.slow
def test_default_run_on_the_embedded_corpus(tmp_path):
    # Every default (corpus, SentencePiece at 2048, the 1.1M-parameter GPT, data=-1, the
    # workdir runs/default below the current directory) except the length: 40 steps
    # instead of 1200 and a private cache directory.
    workdir = tmp_path / "runs" / "default"
    r = run_tfllm(
        "train", "--set", "train.steps=40", "--set", "train.log_every=10",
        "--set", "train.eval_every=20", "--set", "train.eval_steps=4",
        "--set", f"data.data_dir={tmp_path / 'cache'}", "--set", "train.sample_tokens=16",
        timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "step 40/40" in out and "tok/s" in out and "MFU" in out and "ETA" in out
    assert "sample: def " in out
    records = metrics_records(workdir)
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2
    # 40 steps already beat a uniform guess over the 2048 pieces by a wide margin
    # (ln 2048 = 7.62); the full 1200-step run reaches 3.59 (README, docs/training.md).
    assert evals[-1] < math.log(2048) - 1.5
    assert evals[-1] < evals[0]
    assert (workdir / "tokenizer" / "tokenizer.model").exists()
    assert (workdir / "loss.png").exists()
    assert os.listdir(workdir / "checkpoints") == ["step_00000040"]
    # what the README's table lists, in the workdir itself (a relative --workdir once
    # wrote all but checkpoints/ into runs/default/runs/default/)
    assert {"config.yaml", "metrics.jsonl", "tensorboard", "loss.png", "checkpoints",
            "tokenizer", "costs.json", ".tfllm-run"} <= set(os.listdir(workdir))
    assert sorted(os.listdir(tmp_path)) == ["cache", "runs"]
    assert os.listdir(tmp_path / "runs") == ["default"]
    assert "runs" not in os.listdir(workdir)


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_redraws_one_line_with_step_loss_speed_mfu_eta():
    out = _Tty()
    p = Progress(100, "auto", out, peak=Peak(1e9, "datasheet", measured=False),
                 flops_per_token=1e4)
    p.update(50, {"loss": 2.5}, tokens_per_s=20000.0, eta_s=75, logged=True)
    p.message("validation loss 2.4")
    p.close()
    text = out.getvalue()
    assert text.startswith("\r[############............] step 50/100  loss 2.5000")
    assert "20.0k tok/s  MFU 20.0%  ETA 0:01:15" in text
    assert "\nvalidation loss 2.4\n" in text  # a message never lands inside the bar


def test_progress_lines_mode_prints_logged_steps_only():
    out = io.StringIO()  # not a terminal: auto means lines
    p = Progress(10, "auto", out)
    p.update(1, {"loss": 3.0, "grad_norm": 1.0, "learning_rate": 1e-3}, 0.0, 0.0, True)
    p.update(2, {"loss": 2.9}, 100.0, 8.0, False)
    assert out.getvalue().splitlines() == [
        "step 1/10  loss 3.0000  grad_norm 1.000  lr 1.00e-03  0 tok/s  MFU -  ETA 0:00:00"]
