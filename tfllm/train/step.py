"""The train step: forward, masked cross-entropy (fp32), backward, clip, AdamW update.

One `tf.function` (XLA-compiled when `jit_compile`) over micro-batches laid out as
(grad_accum_steps, micro_batch, length + 1) with the micro-batch dimension sharded by
the rules table. Gradients are averaged over micro-batches before one update.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tfllm import internals
from tfllm.compiler.jit import compile_fn
from tfllm.data import feed
from tfllm.models.loss import token_nll
from tfllm.models.common.moe import SUMMED_METRICS, collecting_router_stats
from tfllm.models.common.noise import noise_seed
from tfllm.optim.adamw import global_norm
from tfllm.parallel.placement import Parallel, new_variable, to_numpy
from tfllm.precision import fp8


def lm_forward(model, micro, packing_mask: bool):
    """Logits and targets of one micro-batch: (tokens), (tokens, segment_ids) or (tokens,
    segment_ids, loss_mask) rows of T+1 tokens. Returns (logits (M, T, V) float32,
    targets (M, T), segment ids or None).
    """
    tokens, segment_ids = micro[:2] if isinstance(micro, (tuple, list)) else (micro, None)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (M, T) each
    if segment_ids is not None and packing_mask:
        return model(inputs, segment_ids=segment_ids[:, :-1]), targets, segment_ids
    return model(inputs), targets, segment_ids


def after_backward(micro, gradient):
    """`micro` (a micro-batch) as a value that exists only once `gradient` does.

    The step unrolls its micro-batches into one program, and left alone XLA and the
    executor run every forward pass before the backward passes: all micro-batches'
    activations alive at once, so accumulation saved no memory (the compiled H100 program
    of llama-1b on fsdp=8 with 8 micro-batches kept ~8x one micro-batch's temporaries).
    Micro-batch i's tokens take a data dependency (an integer zero OR-ed into their bits;
    control edges do not survive DTensor's lowering) on
    the gradient of the first trainable variable after micro-batch i-1, which the backward
    pass makes last (the embedding's, or the first block's reduced together with its
    block), so one micro-batch's activations are alive at a time. Costs one scalar
    all-reduce per micro-batch where that gradient is sharded.
    """
    # `sum > inf` is false for every value, NaN and Inf included, and XLA does not fold
    # it (it folds `bits & 0`, the form of `tfllm.parallel.fsdp.zero_after`, so inside
    # one XLA cluster that zero orders nothing: checked on the optimized HLO)
    total = tf.reduce_sum(tf.cast(tf.stop_gradient(gradient), tf.float32))
    tokens = micro[0] if isinstance(micro, (tuple, list)) else micro
    tokens = tf.bitwise.bitwise_or(tokens, tf.cast(total > float("inf"), tokens.dtype))
    if isinstance(micro, (tuple, list)):
        return type(micro)([tokens, *micro[1:]])
    return tokens


def trained_targets(micro):
    """(M, T) float32: 1 where a target is trained, from a micro-batch's loss mask (chat
    data, `tfllm.data.chat`), or None when every target trains (text data)."""
    if not isinstance(micro, (tuple, list)) or len(micro) < 3:
        return None
    return tf.cast(micro[2][:, 1:], tf.float32)  # the mask of each target token


class TrainStep:
    """Compiles and runs the training step of `model` with `optimizer`.

    Args:
      model: a built `tfllm.models.CausalLM` whose variables are placed.
      optimizer: a built `tfllm.optim.AdamW` over the model's trainable variables.
      parallel: the sharding setup, or None for one device.
      jit_compile: XLA-compile the step (on a mesh: XLA clusters of each device's
        program, see `tfllm.compiler.jit`).
      loss_scale: a `tfllm.precision.loss_scale.DynamicLossScale` (float16), or None.
      packing_mask: mask attention to each packed document (segment ids).
      objective: a micro-batch loss beside SFT's, objective(model, micro, forward, seed)
        -> (loss, metrics) (`tfllm.train.dpo.DpoLoss`); None: SFT's cross-entropy.
    """

    def __init__(self, model, optimizer, parallel: Optional[Parallel], jit_compile: bool,
                 loss_scale=None, packing_mask: bool = False, objective=None):
        self.model, self.optimizer, self.parallel = model, optimizer, parallel
        self.jit_compile = jit_compile
        self.loss_scale = loss_scale
        self.packing_mask = packing_mask
        self.objective = objective
        # Steps the guard skipped (non-finite loss or gradient norm, or a loss spike).
        self.skipped = new_variable(parallel, (), (), ("zeros",), "int64", "guard_skipped")
        self.variables = list(model.trainable_variables)
        # FP8 amax histories: their "gradients" are their new values (overwrite).
        self.fp8_state = list(model.fp8_state_variables())
        #: the compiled step (a `tf.function` of (micro-batches, loss limit)) that calls run;
        #: `tfllm.plan.export_step` reads its HLO
        self.compiled = compile_fn(self._train_step, parallel, jit_compile)
        self._grads = compile_fn(self._loss_and_grads, parallel, jit_compile)

    def _forward(self, model, micro):
        return lm_forward(model, micro, self.packing_mask)

    def _micro(self, micro, trained_tokens=None, seed=None, reference=None):
        """(loss, metrics) of one micro-batch: the objective's (with its reference terms,
        `reference`), or SFT's (no metrics)."""
        if self.objective is not None:
            return self.objective(self.model, micro, self._forward, seed,
                                  reference_logps=reference)
        return self._sft_micro(micro, trained_tokens, seed)

    def _sft_micro(self, micro, trained_tokens=None, seed=None):
        # A training forward pass: LoRA dropout acts (if any); mixtures of experts hand
        # over their router statistics (the aux loss and router metrics).
        with noise_seed(seed), collecting_router_stats() as router_stats:
            logits, targets, _ = lm_forward(self.model, micro, self.packing_mask)
        mask = trained_targets(micro)
        if mask is None:
            loss = self.model.compute_lm_loss(logits, targets)
        else:
            # Summed over this micro-batch's trained targets and divided by those of the
            # whole global batch (times the number of micro-batches, which the caller
            # divides by): the step's loss is the mean over every trained token.
            nll = token_nll(logits, targets)  # (M, T)
            loss = tf.reduce_sum(nll * mask) / trained_tokens
        if not router_stats:
            return loss, {}
        # Per micro-batch, as transformers adds it to each forward pass's loss; the step
        # averages both over micro-batches.
        router_loss, metrics = self.model.router_losses(router_stats)
        return loss + router_loss, metrics

    def _loss_and_grads(self, micro_batches):
        """Mean loss, gradients, new FP8 histories and the objective's mean metrics over a
        tuple of micro-batches."""
        accum = len(micro_batches)
        trained_tokens = None
        if self.objective is None and trained_targets(micro_batches[0]) is not None:
            trained_tokens = tf.maximum(tf.add_n([tf.reduce_sum(trained_targets(m))
                                                  for m in micro_batches]), 1.0) / accum
        scale = self.loss_scale.scale if self.loss_scale is not None else None
        fp8_handles = [v.value for v in self.fp8_state]
        total_loss, total_grads, fp8_new, total_metrics = 0.0, None, None, {}
        # Dropout masks differ per optimizer step and micro-batch (and layer).
        noisy = any(getattr(l, "lora", None) and l.lora.dropout
                    for l in internals.all_layers(self.model))
        step = tf.cast(self.optimizer.iterations, tf.int64) * accum if noisy else None
        # Delayed scaling's amaxes of every micro-batch, reduced together at the end
        # (tfllm.precision.fp8: one all-reduce per layout, not one per operand).
        amaxes = fp8.AmaxCollector()
        for i, tokens in enumerate(micro_batches):  # unrolled: grad_accum_steps is small
            if total_grads:  # one micro-batch after another (see `after_backward`)
                tokens = after_backward(tokens, total_grads[0])
            # DPO's reference pass, outside the tape: nothing of it is kept for backward
            reference = (self.objective.reference_logps(self.model, tokens, self._forward)
                         if self.objective is not None else None)
            with fp8.collecting_amaxes(amaxes):
                with tf.GradientTape() as tape:
                    tape.watch(fp8_handles)
                    loss, metrics = self._micro(tokens, trained_tokens,
                                                None if step is None else step + i, reference)
                    scaled = loss * scale if scale is not None else loss
                out = tape.gradient(scaled, self.variables + fp8_handles)
            # Embedding lookups give IndexedSlices; accumulate and clip dense tensors.
            grads = [tf.convert_to_tensor(g) for g in out[:len(self.variables)]]
            histories = out[len(self.variables):]
            total_loss = total_loss + loss
            total_metrics = {k: total_metrics.get(k, 0.0) + v for k, v in metrics.items()}
            total_grads = grads if total_grads is None else [
                a + b for a, b in zip(total_grads, grads)]
            # Each micro-batch rolls the same old history; keep the largest amaxes.
            fp8_new = histories if fp8_new is None else [
                b if a is None else a if b is None else tf.maximum(a, b)
                for a, b in zip(fp8_new, histories)]
        if amaxes:
            # A collected history's "gradient" is None, or zeros where a recomputation
            # (model.remat=full) asked its tape for every variable it read: its new value
            # is the collector's, always.
            collected = amaxes.amaxes(self.fp8_state)
            fp8_new = [h if a is None else fp8.roll_history(tf.convert_to_tensor(v), a)
                       for v, h, a in zip(self.fp8_state, fp8_new, collected)]
        divisor = accum * scale if scale is not None else accum
        grads = [g / divisor for g in total_grads]
        return (total_loss / accum, grads, fp8_new,
                {k: v if k in SUMMED_METRICS else v / accum
                 for k, v in total_metrics.items()})

    def _train_step(self, micro_batches, loss_limit):
        """One guarded optimizer step.

        The update is applied only when the loss and the gradient norm are finite and the
        loss is at most `loss_limit` (inf unless the loss-spike guard is on). The decision
        is made in the graph from globally reduced values, so every client skips together.
        """
        loss, grads, fp8_new, metrics = self._loss_and_grads(micro_batches)
        # Reported: inf or NaN on a non-finite step. On a mesh, one scalar all-reduce per
        # set of sharded axes, not one per gradient.
        raw_norm = (self.parallel.global_norm(grads, self.variables) if self.parallel
                    else global_norm(grads))
        grads_finite = tf.math.is_finite(raw_norm)
        ok = tf.logical_and(tf.logical_and(grads_finite, tf.math.is_finite(loss)),
                            loss <= loss_limit)
        # Non-finite values must not reach the update arithmetic (multiply_no_nan
        # gives 0 for NaN * 0; DTensor crashes on a scalar-condition where).
        on = tf.cast(ok, tf.float32)
        grads = [tf.math.multiply_no_nan(g, on) for g in grads]
        # The norm of the masked gradients: the raw norm, or 0 on a skipped step.
        _, lr = self.optimizer.apply(grads, apply_update=ok,
                                     norm=tf.math.multiply_no_nan(raw_norm, on))
        for var, new in zip(self.fp8_state, fp8_new):
            # A skipped step keeps the old histories (its amaxes may be inf/NaN).
            var.assign(tf.math.multiply_no_nan(new, on) + var.value * (1.0 - on))
        one = tf.ones_like(self.skipped)
        skipped = self.skipped + one * tf.cast(tf.logical_not(ok), one.dtype)
        self.skipped.assign(skipped)
        out = {"loss": loss, "grad_norm": raw_norm, "learning_rate": lr,
               "skipped_steps": tf.cast(skipped, tf.float32),
               "step_ok": tf.cast(ok, tf.float32), **metrics}
        if self.loss_scale is not None:
            new_scale, _ = self.loss_scale.update(grads_finite)
            out["loss_scale"] = new_scale
        return out

    def __call__(self, tokens, loss_limit: float = float("inf"), fetch: bool = True,
                 reader: Optional[Callable] = None) -> dict:
        """Runs one optimizer step on device tokens; returns its metrics.

        Args:
          tokens: micro-batches from the device feed (`tfllm.data.feed.to_device`,
            `DeviceFeed.train_batch`).
          loss_limit: skip the update when the loss exceeds this (the spike guard).
          fetch: return Python floats (waits for the step); False returns the device
            tensors at once, so the host can prepare the next step while this one runs.
          reader: runs the compiled step as `reader(compiled, args)` instead: the
            compiler's `tfllm.compiler.reports.FirstCall`, which reads what the first
            call executed (what XLA compiled, what the step communicates).
        """
        args = (tokens, feed.place(self.parallel, np.float32(loss_limit), ()))
        out = self.compiled(*args) if reader is None else reader(self.compiled, args)
        if not fetch:
            return dict(out)
        return {k: metric_value(to_numpy(v)) for k, v in out.items()}

    def loss_and_grads(self, tokens, with_metrics: bool = False):
        """(loss, gathered numpy gradients) without updating: for parity tests; with
        `with_metrics` also the objective's metrics ({name: float}; empty for SFT)."""
        loss, grads, _, metrics = self._grads(tokens)
        out = float(to_numpy(loss)), [to_numpy(g) for g in grads]
        if with_metrics:
            return out + ({k: metric_value(to_numpy(v)) for k, v in metrics.items()},)
        return out


def metric_value(value):
    """A fetched metric as metrics.jsonl holds it: a float, or nested lists of whole
    numbers for counts (a mixture of experts' `moe_expert_tokens`: sparse layers x
    experts)."""
    value = np.asarray(value)
    if value.ndim == 0:
        return float(value)
    return [metric_value(v) if v.ndim else int(round(float(v))) for v in value]
