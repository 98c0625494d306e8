"""The loss-curve PNG written into the workdir."""

from __future__ import annotations

import os

from tfllm.checkpoint.workdir import read_metrics
from tfllm.confined import open_for_writing


def plot_loss(metrics_path: str, png_path: str) -> str:
    """Draws training (and validation) loss against step into `png_path`.

    Args:
      metrics_path: WORKDIR/metrics.jsonl.
      png_path: the output file (written atomically).

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
    ax.legend()
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    with open_for_writing(tmp, "wb") as f:  # a link planted at the name is refused
        fig.savefig(f, format="png")
    os.replace(tmp, png_path)
    return png_path
