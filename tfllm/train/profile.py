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
import re
from collections import defaultdict
from typing import Dict, List, Optional

from tfllm import files
from tfllm.runpaths import RunPaths


def profile_dir(workdir: str, client: int = 0) -> str:
    """Where a client's traces go (TensorBoard's log directory for them)."""
    return RunPaths(workdir).traces(client)


class StepProfiler:
    """TensorFlow's profiler, started before the first traced step and stopped after the
    last (which steps: `tfllm.train.schedule.Schedule`, from `train.profile_steps`).

    Args:
      logdir: TensorBoard log directory of this client.
      root: the folder tfllm owns that holds `logdir` (the workdir); default: its parent.
    """

    def __init__(self, logdir: str, root: Optional[str] = None):
        self.logdir, self.active = logdir, False
        self.root = root or os.path.dirname(logdir)

    def start(self) -> None:
        if not self.active:
            import tensorflow as tf

            from tfllm.train.tensorboard import storage_errors_named  # TensorFlow's
            # TensorFlow writes the trace by path: into folders made here, no link
            files.make_dirs(self.root, self.logdir)
            with storage_errors_named(self.logdir):
                tf.profiler.experimental.start(self.logdir, options=tf.profiler.experimental.
                                               ProfilerOptions(host_tracer_level=2,
                                                               device_tracer_level=1,
                                                               python_tracer_level=0))
            self.active = True

    def stop(self) -> None:
        if self.active:
            import tensorflow as tf

            from tfllm.train.tensorboard import storage_errors_named  # TensorFlow's
            self.active = False
            with storage_errors_named(self.logdir):  # the trace is written as it stops
                tf.profiler.experimental.stop()


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
       "top": [(op name, ms, count), ...],
       "collectives": {"count": collective ops run (DTensor's all-reduces and
         all-gathers: TF's Collective* ops, NCCL kernels), "ms": their time,
         "top": [(op name, ms, count), ...],
         "overlapped_ms": of the time some collective ran, how much some compute op
           (a TF op or GPU kernel that is not a collective nor a function call) ran
           too, on any line of the plane: communication hidden behind compute},
       "memory": {"peak_bytes": the most bytes an allocator held during the trace,
         "peak_allocator", "peak_op": the op whose allocation reached it,
         "allocations": allocations traced} (planes with allocator events only)}}}.
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
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        events, memory = 0, {"peak_bytes": 0, "peak_allocator": None, "peak_op": None,
                             "allocations": 0}
        spans = {"collective": [], "compute": []}
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                totals[name][0] += event.duration_ps / 1e9
                totals[name][1] += 1
                events += 1
                if event.duration_ps:
                    start = line.timestamp_ns * 1000 + event.offset_ps
                    kind = ("collective" if _COLLECTIVE.search(name)
                            else "compute" if _compute(name) else None)
                    if kind:
                        spans[kind].append((start, start + event.duration_ps))
                if name == "MemoryAllocation":
                    _allocation(event, stat_names, memory)
        if not events:
            continue
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
        collectives = [(n, ms, c) for n, (ms, c) in ranked if _COLLECTIVE.search(n)]
        planes[plane.name] = {
            "events": events, "event_ms": sum(ms for ms, _ in totals.values()),
            "top": [(name, ms, n) for name, (ms, n) in ranked[:top]],
            "collectives": {"count": sum(c for _, _, c in collectives),
                            "ms": sum(ms for _, ms, _ in collectives),
                            "top": collectives[:top],
                            "overlapped_ms": _overlap(spans["collective"],
                                                      spans["compute"]) / 1e9}}
        if memory["allocations"]:
            planes[plane.name]["memory"] = memory
    return {"file": path, "planes": planes}


#: op events that are collectives: TF's Collective*V2 kernels DTensor's all-reduces and
#: all-gathers lower to (their event names end in ":CollectiveReduceV2" etc.), NCCL
#: kernels on GPUs, XLA's all-reduce/all-gather/reduce-scatter thunks
_COLLECTIVE = re.compile(r":Collective\w+V\d|nccl|all-reduce|all-gather|reduce-scatter",
                         re.I)


#: TF op events are "name:Type"; these types only wrap other ops (function calls, the
#: executor's bookkeeping), or are not compute
_WRAPPERS = re.compile(r":(\w*PartitionedCall|_XlaRun|_XlaCompile|XlaLaunch|While|If|"
                       r"Identity|NoOp|Const|_Recv|_Send|_Arg|_Retval|ReadVariableOp|"
                       r"CopyToMesh\w*|Relayout\w*|DTensor\w*)$")


def _compute(name: str) -> bool:
    """Whether an event is a compute op: a TF op ("name:Type") or a GPU kernel / XLA op
    (no ":"; not TF's or the profiler's own bookkeeping), neither a collective nor a
    wrapper."""
    if _BOOKKEEPING.match(name):
        return False
    return not _WRAPPERS.search(name) if ":" in name else True


#: events of TF's executor, the eager runtime and the profiler itself, not ops
_BOOKKEEPING = re.compile(r"(\$|ExecutorState|ThreadpoolListener|__inference|Iterator|"
                          r"MemoryAllocation|MemoryDeallocation|Eager|FunctionRun|"
                          r"Rendezvous)")


def _merged(spans):
    out = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _overlap(a, b) -> int:
    """Length of (union of spans a) intersected with (union of spans b), in the spans'
    unit."""
    a, b = _merged(a), _merged(b)
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _allocation(event, stat_names, memory) -> None:
    """Folds one MemoryAllocation event (its stats: bytes_allocated = bytes the
    allocator holds after it, allocator_name, tf_op) into `memory`."""
    stats = {}
    for stat in event.stats:
        key = stat_names.get(stat.metadata_id)
        if key == "bytes_allocated":
            stats[key] = stat.uint64_value or stat.int64_value
        elif key in ("allocator_name", "tf_op"):  # a string, or a reference to one
            stats[key] = stat.str_value or stat_names.get(stat.ref_value)
    memory["allocations"] += 1
    held = int(stats.get("bytes_allocated") or 0)
    if held > memory["peak_bytes"]:
        memory.update(peak_bytes=held, peak_allocator=stats.get("allocator_name"),
                      peak_op=stats.get("tf_op"))
