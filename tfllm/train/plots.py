"""The loss-curve PNG written into the workdir."""

from __future__ import annotations

import io
import os

from tfllm import files
from tfllm.checkpoint.workdir import read_metrics


def plot_loss(metrics_path: str, png_path: str) -> str:
    """Draws training (and validation) loss against step into `png_path`.

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
    if train or evals:  # an empty plot has nothing to name (and matplotlib warns)
        ax.legend()
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png")
    # loss.png.tmp.png, then renamed; a link planted at either name is refused
    files.write_atomically(os.path.dirname(os.path.abspath(png_path)), png_path,
                           image.getvalue(), suffix=".tmp.png")
    return png_path
