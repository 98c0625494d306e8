"""The train step: forward, masked cross-entropy (fp32), backward, clip, AdamW update.

One `tf.function` (XLA-compiled when `jit_compile`) over micro-batches laid out as
(grad_accum_steps, micro_batch, length + 1) with the micro-batch dimension sharded by
the rules table. Gradients are averaged over micro-batches before one update.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tfllm.optim.adamw import global_norm
from tfllm.parallel import context
from tfllm.parallel.placement import Parallel, to_numpy

BATCH_AXES = ("activation_batch", "activation_length")


def resolve_jit(setting: str) -> bool:
    """train.jit_compile: 'auto' means XLA on every device type.

    On GPU XLA is the point. On a 2-core CPU XLA and plain graphs measured equal within
    noise (benchmarks/results/cpu_jit.md: 0.98x-1.01x over three configs, first step
    4.5-5 s either way), so CPU runs use the same compiled program as GPU runs.
    """
    if setting in ("true", "false"):
        return setting == "true"
    return True


class TrainStep:
    """Compiles and runs the training step of `model` with `optimizer`.

    Args:
      model: a built `tfllm.models.CausalLM` whose variables are placed.
      optimizer: a built `tfllm.optim.AdamW` over the model's trainable variables.
      parallel: the sharding setup, or None for one device.
      jit_compile: XLA-compile the step.
      loss_scale: a `tfllm.precision.loss_scale.DynamicLossScale` (float16), or None.
    """

    def __init__(self, model, optimizer, parallel: Optional[Parallel], jit_compile: bool,
                 loss_scale=None):
        self.model, self.optimizer, self.parallel = model, optimizer, parallel
        self.jit_compile = jit_compile
        self.loss_scale = loss_scale
        self.variables = list(model.trainable_variables)
        # FP8 amax histories: their "gradients" are their new values (overwrite).
        self.fp8_state = list(model.fp8_state_variables())
        self._step = tf.function(self._train_step, jit_compile=jit_compile)
        self._grads = tf.function(self._loss_and_grads, jit_compile=jit_compile)

    def batch_spec(self, shape):
        return self.parallel.spec("batch", shape, BATCH_AXES) if self.parallel else None

    def to_device(self, tokens: np.ndarray):
        """A global (A, M, T+1) token array as this step's input: a tuple of A micro-batches
        (M, T+1), each sharded over the batch axis when on a mesh.

        Separate tensors, not one (A, M, T+1) DTensor: DTensor loses the layout of the
        micro-batch dimension when slicing out one micro-batch with a shrinking index.
        """
        if self.parallel is None:
            return tuple(tf.constant(t) for t in tokens)
        spec = self.batch_spec(tokens.shape[1:])
        return tuple(self.parallel.shard_array(t, spec) for t in tokens)

    def _micro(self, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (M, T) each
        logits = self.model(inputs)  # (M, T, V) float32
        return self.model.compute_lm_loss(logits, targets)

    def _loss_and_grads(self, micro_batches):
        """Mean loss, gradients and new FP8 histories over a tuple of micro-batches."""
        with context.use(self.parallel):
            accum = len(micro_batches)
            scale = self.loss_scale.scale if self.loss_scale is not None else None
            fp8_handles = [v.value for v in self.fp8_state]
            total_loss, total_grads, fp8_new = 0.0, None, None
            for tokens in micro_batches:  # unrolled: grad_accum_steps is small and static
                with tf.GradientTape() as tape:
                    tape.watch(fp8_handles)
                    loss = self._micro(tokens)
                    scaled = loss * scale if scale is not None else loss
                out = tape.gradient(scaled, self.variables + fp8_handles)
                # Embedding lookups give IndexedSlices; accumulate and clip dense tensors.
                grads = [tf.convert_to_tensor(g) for g in out[:len(self.variables)]]
                histories = out[len(self.variables):]
                total_loss = total_loss + loss
                total_grads = grads if total_grads is None else [
                    a + b for a, b in zip(total_grads, grads)]
                # Each micro-batch rolls the same old history; keep the largest amaxes.
                fp8_new = histories if fp8_new is None else [
                    tf.maximum(a, b) for a, b in zip(fp8_new, histories)]
            divisor = accum * scale if scale is not None else accum
            grads = [g / divisor for g in total_grads]
            return total_loss / accum, grads, fp8_new

    def _train_step(self, micro_batches):
        loss, grads, fp8_new = self._loss_and_grads(micro_batches)
        with context.use(self.parallel):
            finite = None
            if self.loss_scale is not None:
                from tfllm.precision.loss_scale import all_finite
                finite = all_finite(grads)
                # Non-finite values must not reach the norm and the update arithmetic
                # (multiply_no_nan gives 0 for NaN * 0; DTensor crashes on a scalar where).
                on = tf.cast(finite, tf.float32)
                raw_norm = global_norm(grads)  # reported: inf or NaN on a skipped step
                grads = [tf.math.multiply_no_nan(g, on) for g in grads]
            grad_norm, lr = self.optimizer.apply(grads, apply_update=finite)
            if finite is not None:
                grad_norm = raw_norm
            for var, new in zip(self.fp8_state, fp8_new):
                var.assign(new)
            out = {"loss": loss, "grad_norm": grad_norm, "learning_rate": lr}
            if self.loss_scale is not None:
                new_scale, skipped = self.loss_scale.update(finite)
                out["loss_scale"] = new_scale
                out["skipped_steps"] = tf.cast(skipped, tf.float32)
        return out

    def __call__(self, tokens) -> dict:
        """Runs one optimizer step on device tokens; returns numpy float metrics."""
        out = self._step(tokens)
        return {k: float(to_numpy(v)) for k, v in out.items()}

    def loss_and_grads(self, tokens):
        """(loss, gathered numpy gradients) without updating: for parity tests."""
        loss, grads, _ = self._grads(tokens)
        return float(to_numpy(loss)), [to_numpy(g) for g in grads]
