"""The loss-curve PNG leaves the caller's matplotlib alone."""

import json

import matplotlib
import matplotlib.pyplot as plt

from tfllm.train.plots import plot_loss


def test_plot_loss_keeps_the_callers_backend_and_figures(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0}, {"step": 2, "eval_loss": 3.2}]))
    backend = matplotlib.get_backend()
    before = plt.get_fignums()  # figures other tests left open are not this test's business
    mine = plt.figure()  # a notebook's open figure
    try:
        png = plot_loss(str(metrics), str(tmp_path / "loss.png"))
        # A notebook that trains keeps its inline backend (the loop draws this at the
        # end of every run), and pyplot did not gain the loop's figure.
        assert matplotlib.get_backend() == backend
        assert plt.get_fignums() == before + [mine.number]
    finally:
        plt.close(mine)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
