"""What happens at step n of a run: log, evaluate, save, trace. Pure: no TensorFlow.

The loop (`tfllm.train.loop`) asks `Schedule.at(n)` once per step and does what the
answer says; what it decides as it runs (a signal's stop, the first step's report, a
trace that really started) it adds itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class StepEvents:
    """What the schedule asks of step `number` (1-based).

    Attributes:
      number: the step.
      log: a record goes to metrics.jsonl, TensorBoard and the display (every
        `train.log_every` steps, the first and the last).
      evaluate: the validation loss is computed after the step (every `train.eval_every`
        steps, not the last: the final evaluation follows the final save).
      save: a checkpoint is saved after the step (every `checkpoint.every` steps, not the
        last: the final save follows the loop).
      trace_starts, trace_ends: the profiler starts before the step, stops after it
        (`train.profile_steps`).
      last: the run's last step.
      read: the step's metrics are brought to the host (what it logs, evaluates or saves
        needs them, as does the loss-spike guard at every step); otherwise they stay
        on the devices and the host prepares the next step.
    """

    number: int
    log: bool
    evaluate: bool
    save: bool
    trace_starts: bool
    trace_ends: bool
    last: bool
    read: bool


@dataclass(frozen=True)
class Schedule:
    """The step schedule of a run.

    Args:
      steps: train.steps.
      log_every: train.log_every.
      eval_every: train.eval_every; 0: never (also when there is no validation data).
      save_every: checkpoint.every; 0: only the final save.
      profile: the (first, last) steps traced (`tfllm.config.loader.profile_steps`), or
        None.
      spike_guard: train.loss_spike_factor > 0 (every step's loss is read).
    """

    steps: int
    log_every: int
    eval_every: int = 0
    save_every: int = 0
    profile: Optional[Tuple[int, int]] = None
    spike_guard: bool = False

    def at(self, number: int) -> StepEvents:
        """What happens at step `number` (1-based)."""
        last = number == self.steps
        log = number % self.log_every == 0 or last or number == 1
        evaluate = bool(self.eval_every) and number % self.eval_every == 0 and not last
        save = bool(self.save_every) and number % self.save_every == 0 and not last
        return StepEvents(
            number=number, log=log, evaluate=evaluate, save=save,
            trace_starts=bool(self.profile) and number == self.profile[0],
            trace_ends=bool(self.profile) and number == self.profile[1], last=last,
            read=log or evaluate or save or last or self.spike_guard)
