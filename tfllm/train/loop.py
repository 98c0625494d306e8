"""The training loop: set up the mesh, model, optimizer and step; run; log metrics."""

from __future__ import annotations

import json
import os
import sys
import time

from tfllm.config import save_config
from tfllm.data import SyntheticTokens
from tfllm.models import build_model
from tfllm.optim import AdamW
from tfllm.parallel import make_parallel
from tfllm.parallel.mesh import check_batch
from tfllm.precision import describe
from tfllm.train.step import TrainStep, resolve_jit
from tfllm.train.tensorboard import TensorBoard


class Run:
    """Everything a training run needs, set up from a config.

    Args:
      config: a validated `tfllm.config.Config`.
      model_cls: a `CausalLM` subclass to train instead of the config's family.
    """

    def __init__(self, config, model_cls=None):
        self.config = config
        self.parallel = make_parallel(config)
        t = config.train
        self.batch_axis = self.parallel.spec(
            "batch", (t.global_batch_size // t.grad_accum_steps, config.data.sequence_length + 1),
            ("activation_batch", "activation_length"))[0]
        check_batch(t.global_batch_size, t.grad_accum_steps, self.batch_axis,
                    self.parallel.shape)
        self.model = build_model(config, self.parallel, model_cls=model_cls)
        self.optimizer = AdamW(config.optimizer, t.steps, self.parallel)
        self.optimizer.build(self.model.trainable_variables)
        self.jit_compile = resolve_jit(t.jit_compile)
        self.loss_scale = None
        if config.precision.policy == "float16":
            from tfllm.precision.loss_scale import DynamicLossScale
            self.loss_scale = DynamicLossScale(config.precision.loss_scale_initial,
                                               config.precision.loss_scale_growth_interval,
                                               self.parallel)
        self.step = TrainStep(self.model, self.optimizer, self.parallel, self.jit_compile,
                              self.loss_scale)
        self.data = SyntheticTokens(config.model.vocab_size, config.data.sequence_length + 1,
                                    config.data.seed)

    def idle_batch_axes(self):
        """Batch-capable mesh axes (size > 1) that the batch does not use."""
        p = self.parallel
        return sorted(a for a in p.batch_mesh_axes
                      if p.shape.get(a, 1) > 1 and a != self.batch_axis)

    def batch(self, step: int):
        t = self.config.train
        return self.step.to_device(self.data.batch(step, t.global_batch_size, t.grad_accum_steps))


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def train(config, workdir: str, model_cls=None, out=sys.stdout) -> dict:
    """Trains per `config`, writing WORKDIR/config.yaml and WORKDIR/metrics.jsonl.

    Args:
      config: a validated `tfllm.config.Config`.
      workdir: the run directory (created if missing).
      model_cls: optional `CausalLM` subclass.
      out: where progress lines go.

    Returns:
      The last logged metrics.
    """
    run = Run(config, model_cls)
    from tfllm.parallel.mesh import client_id
    primary = client_id() == 0
    if not primary:
        # Only client 0 writes metrics, TensorBoard, the config and the progress display;
        # the others log to their own file.
        os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
        out = open(os.path.join(workdir, "logs", f"client_{client_id()}.log"), "a")
        metrics_path = os.devnull
    else:
        save_config(config, workdir)
        metrics_path = os.path.join(workdir, "metrics.jsonl")
    t = config.train
    tokens_per_step = t.global_batch_size * config.data.sequence_length
    mesh = ", ".join(f"{k}={v}" for k, v in run.parallel.shape.items())
    print(f"tfllm: {config.model.family} on mesh [{mesh}] ({run.parallel.device_type}), "
          f"jit_compile={run.jit_compile}, {describe(config.precision)}", file=out)
    idle = run.idle_batch_axes()
    if idle:
        print(f"tfllm: note: the batch is sharded over '{run.batch_axis}' only; the devices "
              f"along {', '.join(repr(a) for a in idle)} repeat the same activations "
              "(DTensor shards one tensor dimension over at most one mesh axis).", file=out)
    last = {}
    window_start, window_tokens = None, 0
    start = time.perf_counter()
    tensorboard = TensorBoard(os.path.join(workdir, "tensorboard")) if primary else None
    with open(metrics_path, "a", encoding="utf-8") as metrics_file:
        for step in range(t.steps):
            values = run.step(run.batch(step))
            now = time.perf_counter()
            if window_start is None:  # step 0 includes compilation: not timed
                window_start, window_tokens = now, 0
                first_step_s = now - start
            else:
                window_tokens += tokens_per_step
            number = step + 1
            if number % t.log_every == 0 or number == t.steps or number == 1:
                elapsed = now - window_start
                tps = window_tokens / elapsed if window_tokens else 0.0
                last = {"step": number, **values, "tokens_per_s": tps}
                metrics_file.write(json.dumps(last) + "\n")
                metrics_file.flush()
                remaining = (t.steps - number) * tokens_per_step / tps if tps else 0.0
                extra = (f"  loss_scale {values['loss_scale']:g} skipped "
                         f"{int(values['skipped_steps'])}" if "loss_scale" in values else "")
                print(f"step {number}/{t.steps}  loss {values['loss']:.4f}  "
                      f"grad_norm {values['grad_norm']:.3f}  lr {values['learning_rate']:.2e}  "
                      f"{tps:,.0f} tok/s  eta {_eta(remaining)}{extra}", file=out, flush=True)
                if tensorboard is not None:
                    tensorboard.write(number, last, run.model)
    last["first_step_s"] = first_step_s
    return last
