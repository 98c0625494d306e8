"""A profile of chosen train steps (`train.profile_steps`) and a summary of one.

TensorFlow's profiler traces the steps FIRST..LAST of a run into
WORKDIR/tensorboard/plugins/profile/<time>/<host>.xplane.pb: every op TensorFlow ran on
the host, every XLA cluster and its kernels on each device (GPU kernels through CUPTI),
DTensor's collectives, and memory over the step. TensorBoard's Profile tab reads it
(`tensorboard --logdir WORKDIR/tensorboard`: trace viewer, op profile, memory profile);
`summary` reads the same file without TensorBoard. Each client of a multi-client run
traces its own devices, clients after the first into tensorboard/client_N.

What to look for: in the trace viewer, one row per device; a step is the span from the
first to the last cluster of a device. Gaps between clusters are host time (input,
Python); collectives (`DTensorAllReduce`, NCCL kernels on GPUs) that do not overlap
compute are communication the step waits for; the memory profile's peak is the step's
high-water mark, to compare with `tfllm plan` and `model.remat`.
"""

from __future__ import annotations

import glob
import os
from collections import defaultdict
from typing import Dict, List, Optional, Tuple


def profile_dir(workdir: str, client: int = 0) -> str:
    """Where a client's traces go (TensorBoard's log directory for them)."""
    base = os.path.join(workdir, "tensorboard")
    return base if client == 0 else os.path.join(base, f"client_{client}")


class StepProfiler:
    """Starts TensorFlow's profiler before step FIRST and stops it after step LAST.

    Args:
      steps: (first, last) step numbers (`tfllm.config.loader.profile_steps`), or None.
      logdir: TensorBoard log directory of this client.
    """

    def __init__(self, steps: Optional[Tuple[int, int]], logdir: str):
        self.steps, self.logdir, self.active = steps, logdir, False

    def before(self, number: int) -> None:
        if self.steps and number == self.steps[0] and not self.active:
            import tensorflow as tf
            os.makedirs(self.logdir, exist_ok=True)
            tf.profiler.experimental.start(self.logdir, options=tf.profiler.experimental.
                                           ProfilerOptions(host_tracer_level=2,
                                                           device_tracer_level=1,
                                                           python_tracer_level=0))
            self.active = True

    def ends_at(self, number: int) -> bool:
        """True after the last traced step: the caller waits for the step's results
        (so that its device work is inside the trace), then calls `stop`."""
        return self.active and number == self.steps[1]

    def stop(self) -> None:
        if self.active:
            import tensorflow as tf
            tf.profiler.experimental.stop()
            self.active = False


def trace_files(logdir: str) -> List[str]:
    """The .xplane.pb files under a log directory, newest run last."""
    return sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))


def summary(path: str, top: int = 10) -> Dict[str, object]:
    """What a trace holds, per plane (the host, each device): events and the ops that
    took the most time.

    Args:
      path: an .xplane.pb file (`trace_files`), or a log directory (its newest trace).
      top: how many ops to list per plane.

    Returns:
      {"file": path, "planes": {plane name: {"events": n, "event_ms": time summed over
       events (nested events count in each),
       "top": [(op name, ms, count), ...]}}}.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    if os.path.isdir(path):
        files = trace_files(path)
        if not files:
            raise FileNotFoundError(f"{path}: no profile (plugins/profile/*/*.xplane.pb); "
                                    "train with --set train.profile_steps=FIRST-LAST.")
        path = files[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    planes = {}
    for plane in space.planes:
        totals: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
        events = 0
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                totals[name][0] += event.duration_ps / 1e9
                totals[name][1] += 1
                events += 1
        if not events:
            continue
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
        planes[plane.name] = {"events": events,
                              "event_ms": sum(ms for ms, _ in totals.values()),
                              "top": [(name, ms, n) for name, (ms, n) in ranked]}
    return {"file": path, "planes": planes}
