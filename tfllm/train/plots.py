"""The loss-curve PNG written into the workdir."""

from __future__ import annotations

import io
import os

from tfllm import files
from tfllm.checkpoint.workdir import read_metrics


def plot_loss(metrics_path: str, png_path: str) -> str:
    """Draws training (and validation) loss against step into `png_path`; with DPO
    metrics (TRL's rewards/accuracies) the reward accuracy too, on a second axis.

    Args:
      metrics_path: WORKDIR/metrics.jsonl.
      png_path: the output file in the run directory (written atomically).

    Returns:
      png_path.
    """
    # A bare Figure (no pyplot): nothing global changes, so a notebook or a user's
    # program that trains keeps its own matplotlib backend and open figures. Imported
    # here, not at the top: only the end of a run draws.
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    accuracy = [(r["step"], r["rewards/accuracies"]) for r in records
                if "rewards/accuracies" in r]
    eval_accuracy = [(r["step"], r["eval_rewards/accuracies"]) for r in records
                     if "eval_rewards/accuracies" in r]
    lines = []
    if accuracy or eval_accuracy:  # DPO: the loss is per pair; reward accuracy beside it
        ax.set_ylabel("loss")
        right = ax.twinx()
        right.set_ylabel("reward accuracy")
        right.set_ylim(0, 1)
        if accuracy:
            lines += right.plot(*zip(*accuracy), ":", color="tab:green",
                                label="train reward accuracy")
        if eval_accuracy:
            lines += right.plot(*zip(*eval_accuracy), "s-", color="tab:red",
                                label="validation reward accuracy")
    if train or evals:  # an empty plot has nothing to name (and matplotlib warns)
        handles = ax.get_legend_handles_labels()[0] + lines
        ax.legend(handles, [h.get_label() for h in handles])
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png")
    # loss.png.tmp.png, then renamed; a link planted at either name is refused
    files.write_atomically(os.path.dirname(os.path.abspath(png_path)), png_path,
                           image.getvalue(), suffix=".tmp.png")
    return png_path
