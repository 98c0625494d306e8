"""The live progress display: step, loss, tokens/s, MFU and ETA.

`bar` redraws one line in place (on a terminal); `lines` prints one line per log step
(for log files and CI); `none` prints nothing. `auto` picks bar on a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import Optional


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def format_count(value: float) -> str:
    """12,345 -> '12.3k'; keeps the display one short line."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


class Progress:
    """Shows training progress.

    Args:
      total_steps: the last step number of the run.
      mode: bar, lines, none or auto.
      out: the stream to write to.
      peak: the mesh's peak for MFU (`tfllm.train.metrics.Peak`), or None; without
        one (or with `Peak.flops` None: CPU) MFU shows as "MFU -".
      flops_per_token: training FLOPs per token, for MFU.
      width: bar width in characters.
    """

    def __init__(self, total_steps: int, mode: str = "auto", out=sys.stdout,
                 peak=None, flops_per_token: float = 0.0,
                 width: int = 24):
        if mode == "auto":
            mode = "bar" if hasattr(out, "isatty") and out.isatty() else "lines"
        self.total, self.mode, self.out = total_steps, mode, out
        self.peak, self.flops_per_token, self.width = peak, flops_per_token, width
        self._drawn = False
        self._last_draw = 0.0

    @property
    def has_peak(self) -> bool:
        """Whether MFU can be reported at all (not on CPU: `metrics.NO_CPU_PEAK`)."""
        return self.peak is not None and bool(self.peak.flops)

    def mfu(self, tokens_per_s: float) -> Optional[float]:
        """Model FLOPs utilization (`tfllm.train.metrics.Peak.mfu`: unclamped, warns
        once above 1); None without a peak or before a step was timed."""
        if not self.has_peak or not tokens_per_s:
            return None
        return self.peak.mfu(tokens_per_s, self.flops_per_token)

    def line(self, step: int, metrics: dict, tokens_per_s: float, eta_s: float,
             detail: bool = False) -> str:
        mfu = self.mfu(tokens_per_s)
        parts = [f"step {step}/{self.total}", f"loss {metrics['loss']:.4f}"]
        if "eval_loss" in metrics:
            parts.append(f"val {metrics['eval_loss']:.4f}")
        if "rewards/accuracies" in metrics:  # DPO: TRL's reward accuracy and margin
            parts.append(f"acc {metrics['rewards/accuracies']:.2f}")
            parts.append(f"margin {metrics['rewards/margins']:.3f}")
        if "eval_rewards/accuracies" in metrics:
            parts.append(f"val acc {metrics['eval_rewards/accuracies']:.2f}")
        if detail:
            if "grad_norm" in metrics:
                parts.append(f"grad_norm {metrics['grad_norm']:.3f}")
            if "learning_rate" in metrics:
                parts.append(f"lr {metrics['learning_rate']:.2e}")
            if "loss_scale" in metrics:
                parts.append(f"loss_scale {metrics['loss_scale']:g}")
            if metrics.get("skipped_steps"):
                parts.append(f"skipped {int(metrics['skipped_steps'])}")
        parts.append(f"{format_count(tokens_per_s)} tok/s")
        parts.append(f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU -")
        parts.append(f"ETA {format_eta(eta_s)}")
        return "  ".join(parts)

    def update(self, step: int, metrics: dict, tokens_per_s: float, eta_s: float,
               logged: bool) -> None:
        """Called after every step; `logged` is true on log steps."""
        if self.mode == "none":
            return
        if self.mode == "lines":
            if logged:
                print(self.line(step, metrics, tokens_per_s, eta_s, detail=True),
                      file=self.out, flush=True)
            return
        now = time.monotonic()  # a bar redraw at most 10 times a second
        if not logged and step != self.total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        filled = int(self.width * step / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        self.out.write(f"\r[{bar}] {self.line(step, metrics, tokens_per_s, eta_s)}\033[K")
        self.out.flush()
        self._drawn = True

    def message(self, text: str) -> None:
        """Prints a line without breaking the bar."""
        if self.mode == "none":
            return
        if self._drawn:
            self.out.write("\n")
            self._drawn = False
        print(text, file=self.out, flush=True)

    def close(self) -> None:
        if self._drawn:
            self.out.write("\n")
            self.out.flush()
            self._drawn = False
