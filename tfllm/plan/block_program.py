"""One transformer block's program, as one device of the config's mesh runs it.

`tfllm plan` compiles the whole one-device step at 1 and 2 layers (`tfllm.plan.planner`);
a mesh device runs something else around each block: DTensor hands XLA the block's
*gathered* 16-bit weights (`tfllm.parallel.blocks`), the next block's gather is already
in flight, and under `model.remat=full` the block runs forward again in the backward pass
before its own backward. This module writes that one program, so that its memory is
XLA's buffer assignment, not the fit model's arithmetic (`tfllm.footprint.fit`):

* parameters: the block's input (the activation the step keeps under remat=full), the
  gradient of its output, the rows' token ids (positions are computed from them in the
  program, as the training forward does: `masks.row_positions`), and, captured as
  16-bit variables, the block's gathered weights and those of its prefetched neighbour
  (read, so that they stay parameters: what the mesh keeps alive beside the block);
* the computation: the block's forward under the config's remat (`CausalLM.run_block`),
  then its backward: under `full` the recomputation, gated on the output gradient as in
  the step (`tfllm.models.common.remat`), and the block's backward;
* outputs: the block's output (the next block's input), the input's gradient and the
  block's weight gradients in float32 (the buffer its one reduce-scatter sends).

Shapes are one device's micro-batch (`tfllm.footprint.layout.per_device_config`). An FP8
policy's block is planned as its bfloat16 block (its FP8 kernels gathered as one byte per
value and its amax histories are not modelled here; `tfllm.footprint.layout.MeshPlan.buffers`
counts those).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import tensorflow as tf

from tfllm import files
from tfllm.models import model_class
from tfllm.models.common.masks import row_positions
from tfllm.precision.policies import apply_matmul_precision

#: the Keras policy of a block's gathered weights: its variables are the 16-bit tensors a
#: gather yields (float32 steps gather float32)
_GATHERED_POLICY = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                    "fp8": "bfloat16"}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def export_block(local, out_dir: str) -> dict:
    """Writes `block.hlo.pb` (and `.txt`) to `out_dir`; returns the program's description.

    Args:
      local: the per-device config (`tfllm.footprint.layout.per_device_config`).
      out_dir: the root of these writes (made when missing).

    Returns:
      {"micro_rows", "sequence_length", "policy", "activation_bytes": bytes of the
       block's input, output, output gradient and input gradient (four (B, T, E)
       tensors),
       "token_bytes", "weight_bytes": this block's gathered weights,
       "neighbour_bytes": the prefetched neighbour's, "gradient_bytes": the block's
       float32 weight gradients, "remat"}.
    """
    files.make_dirs(out_dir)
    config = copy.deepcopy(local)
    config.model.num_layers = 2  # the block and its neighbour
    apply_matmul_precision(config.precision)
    policy = _GATHERED_POLICY[config.precision.policy]
    model = model_class(config.model.family)(config.model, dtype=policy)
    model.build(None)
    block, neighbour = model.blocks
    t = config.train
    rows = t.global_batch_size // t.grad_accum_steps
    if t.objective == "dpo":  # a preference pair is two sequences
        rows *= 2
    length, width = config.data.sequence_length, config.model.hidden_dim
    x = tf.zeros((rows, length, width), policy)
    dy = tf.zeros((rows, length, width), policy)
    tokens = tf.zeros((rows, length), tf.int32)
    weights = block.trainable_variables
    kept = neighbour.weights

    @tf.function(jit_compile=True, autograph=False)
    def block_step(x, dy, tokens):
        positions = row_positions(tokens)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model.run_block(block, x, None, positions)
        dx, *dws = tape.gradient(y, [x] + weights, output_gradients=dy)
        # one element of each of the neighbour's weights: they become parameters (alive
        # beside the block, as the prefetched gather is), for no computation
        touch = tf.add_n([tf.cast(tf.reshape(w, [-1])[0], tf.float32) for w in kept])
        # y is returned: the step's next block reads it, and unread, XLA would drop the
        # forward pass that remat=full recomputes
        return y, dx, [tf.cast(g, tf.float32) for g in dws], touch

    ir = block_step.experimental_get_compiler_ir(x, dy, tokens)
    files.write_atomically(out_dir, "block.hlo.pb", ir(stage="hlo_serialized"))
    files.write_atomically(out_dir, "block.hlo.txt", ir(stage="hlo"))
    size = lambda vs: sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize  # noqa: E731
                          for v in vs)
    act = rows * length * width * _BYTES[policy]
    return {"micro_rows": rows, "sequence_length": length, "policy": policy,
            "remat": config.model.remat,
            "activation_bytes": 4 * act, "token_bytes": rows * length * 4,
            "weight_bytes": size(block.weights), "neighbour_bytes": size(kept),
            "gradient_bytes": 4 * sum(math.prod(v.shape) for v in weights)}


def block_memory(desc: dict, compiled: dict) -> dict:
    """The block program's memory as XLA assigned it, in the parts the plan reports.

    Args:
      desc: `export_block`'s description.
      compiled: the compile's memory figures ({arguments, outputs, alias, temp, ...}).

    Returns:
      {"arguments", "outputs", "temp", "peak": arguments + outputs - alias + temp,
       "block_buffers": the buffers a mesh device holds for the block beyond what the
       one-device step holds: XLA's parameter buffers of the gathered weights (the
       block's and its prefetched neighbour's) and its output buffers of the float32
       weight gradients (its parameters and outputs less the block's input, output,
       their gradients and the token ids; XLA adds 8 bytes per output of tuple index),
       "recompute": the temporaries of the block's forward and backward (under
       remat=full the recomputation's live buffers; the 16-bit partial gradients),
       "weights", "gradients": the shapes' bytes, for the cross-check}.
    """
    m = compiled
    peak = m["arguments"] + m["outputs"] - m["alias"] + m["temp"]
    buffers = (m["arguments"] + m["outputs"] - m["alias"] - desc["activation_bytes"]
               - desc["token_bytes"])
    return {"arguments": m["arguments"], "outputs": m["outputs"], "temp": m["temp"],
            "peak": peak, "block_buffers": buffers, "recompute": m["temp"],
            "weights": desc["weight_bytes"] + desc["neighbour_bytes"],
            "gradients": desc["gradient_bytes"]}
