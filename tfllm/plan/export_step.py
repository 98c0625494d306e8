"""Export the compiled train step as portable XLA (HLO) for a machine without TensorFlow.

`tfllm export-step --config C --out DIR` writes, for one device:

* `step.hlo.pb`: the serialized HloModule of the `jit_compile=True` train step that
  `tfllm train` runs (forward, loss, backward, clipping, AdamW update);
* `step.hlo.txt`: the same, as text;
* `step.json`: each HLO parameter (shape, dtype, role: batch, weight, optimizer_state,
  fp8_state, step; named as in a checkpoint, `tfllm.checkpoint.state_name`:
  "model/<path>", "optimizer/m/<path>", "optimizer/v/<path>", ...), each output (metric
  name, or the parameter it updates), FLOPs per token, tokens per step and versions;
* `step.jax` (where the plan extra's jax is installed): the same program as a serialized
  `jax.export.Exported`, which any recent jax runs through public APIs only
  (`tfllm.plan.jax_export`; what `benchmarks/gpu/run_step.py` runs on a lent GPU);
* `check.npz` (with `--check`): the inputs of one step and TensorFlow's outputs, so a
  runner can prove that it executes the same program (`benchmarks/gpu/run_step.py`).
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import tensorflow as tf

from tfllm import files
from tfllm.checkpoint import run_state_variables
from tfllm.checkpoint.shards import tf_variable
from tfllm.data import SyntheticTokens, feed
from tfllm.train.metrics import count_params, flops_per_token
from tfllm.train.state import build_train_state


def _entry_signature(hlo_text: str):
    """(parameter types, output types) of the HLO module's entry computation."""
    entry = next(l for l in hlo_text.splitlines() if l.startswith("ENTRY"))
    params_text, out_text = re.match(r"ENTRY \S+ \((.*)\) -> (.*) \{", entry).groups()
    types = lambda text: re.findall(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]", text)
    return types(params_text), types(out_text)


def synthetic_batch(config, data: SyntheticTokens):
    """A step's input of the config's shapes from synthetic tokens: (A, M, T+1) tokens, or
    for `train.objective=dpo` each micro-batch's (tokens, segment ids, loss mask) of its
    2M rows (pair p in rows 2p and 2p+1, the second half of every row trained), with the
    stored reference log-probabilities as a fourth part under
    `dpo.precompute_reference` (the step `tfllm train` compiles for preference data)."""
    t = config.train
    if t.objective != "dpo":
        return feed.to_device(None, data.batch(0, t.global_batch_size, t.grad_accum_steps))
    tokens = data.batch(0, 2 * t.global_batch_size, t.grad_accum_steps)
    segments = np.ones_like(tokens)
    mask = np.zeros_like(tokens)
    mask[..., tokens.shape[-1] // 2:] = 1
    reference = (np.zeros(tokens.shape[:2], np.float32)
                 if config.dpo.precompute_reference else None)
    return feed.to_device(None, tokens, segments, mask, reference)


def export_step(config, out_dir: str, check: bool = False, portable: bool = True) -> dict:
    """Writes the step's HLO and description to `out_dir` (the root of these writes: made
    when missing); returns the description. `portable`: also write step.jax (where the
    plan extra's jax is installed); the planner, which compiles step.hlo.pb, skips it."""
    files.make_dirs(out_dir)
    # One device, no DTensor: plain XLA parameters.
    state = build_train_state(config, None, jit_compile=True)
    model, optimizer, step = state.model, state.optimizer, state.step
    t = config.train
    data = SyntheticTokens(config.model.vocab_size, config.data.sequence_length + 1,
                           config.data.seed)
    batch = synthetic_batch(config, data)
    flat = tf.nest.flatten(batch)  # a micro-batch is one tensor, or a tuple of its parts
    limit = feed.place(None, np.float32(float("inf")), ())
    ir = step.compiled.experimental_get_compiler_ir(batch, limit)
    hlo_bytes, hlo_text = ir(stage="hlo_serialized"), ir(stage="hlo")
    concrete = step.compiled.get_concrete_function(batch, limit)

    # The names a checkpoint gives the same variables; the role says what each one is.
    ref = lambda var: tf_variable(var).handle.ref()  # noqa: E731
    # LoRA's base weights: read, never updated
    roles = {ref(v): "frozen_weight" for v in model.non_trainable_variables}
    roles.update({ref(v): "weight" for v in model.trainable_variables})
    roles.update({ref(v): "fp8_state" for v in model.fp8_state_variables()})
    roles[ref(optimizer.iterations)] = "step"
    roles[ref(step.skipped)] = "counter"
    for _, m, s in optimizer.states:
        roles[ref(m)] = roles[ref(s)] = "optimizer_state"
    if state.reference is not None:  # DPO's frozen copy (full fine-tuning): read only
        roles.update({ref(v): "reference" for v in state.reference.weights})
    by_handle = {}
    for name, var in run_state_variables(model, optimizer, state.loss_scale,
                                         step.skipped, reference=state.reference).items():
        if ref(var) in roles:
            by_handle[ref(var)] = (roles[ref(var)], name, tf_variable(var, name))

    params = [{"role": "batch", "name": f"tokens/{i}", "shape": list(b.shape),
               "dtype": b.dtype.name} for i, b in enumerate(flat)]
    params.append({"role": "loss_limit", "name": "loss_limit", "shape": [],
                   "dtype": "float32"})
    written, captured = [], []
    for handle in concrete.captured_inputs:
        match = by_handle.get(handle.ref())
        if match is None:
            raise RuntimeError("export-step: the step captures a tensor that is not a "
                               "known variable; cannot describe its HLO parameters.")
        role, name, var = match
        captured.append(var)
        params.append({"role": role, "name": name, "shape": list(var.shape),
                       "dtype": var.dtype.name})
        if role not in ("reference", "frozen_weight"):  # read only; the rest updated
            written.append(len(params) - 1)
    hlo_params, hlo_outputs = _entry_signature(hlo_text)
    if len(hlo_params) != len(params):
        raise RuntimeError(f"export-step: HLO has {len(hlo_params)} parameters, the step "
                           f"{len(params)}; the calling convention changed.")
    metric_names = sorted(concrete.structured_outputs)  # tf.function flattens dicts sorted
    outputs = [{"role": "metric", "name": n} for n in metric_names]
    outputs += [{"role": "update", "param": i, "name": params[i]["name"]} for i in written]
    if len(hlo_outputs) != len(outputs):
        raise RuntimeError(f"export-step: HLO returns {len(hlo_outputs)} values, expected "
                           f"{len(outputs)} (metrics + updated variables).")
    # rows the step trains on: a preference pair is two (chosen, rejected)
    rows = t.global_batch_size * (2 if t.objective == "dpo" else 1)
    tokens_per_step = rows * config.data.sequence_length
    description = {
        "config": {"family": config.model.family, "policy": config.precision.policy,
                   "global_batch_size": t.global_batch_size,
                   "sequence_length": config.data.sequence_length,
                   "vocab_size": config.model.vocab_size},
        "params": params, "outputs": outputs,
        "num_params": count_params(model),
        # projections the fp8 policy quantizes (fp8_exclude leaves bf16): each keeps
        # exactly three amax histories (input, kernel, output gradient)
        "fp8_projections": len(model.fp8_state_variables()) // 3,
        "flops_per_token": flops_per_token(config.model, config.data.sequence_length),
        "tokens_per_step": tokens_per_step,
        "tensorflow": tf.__version__,
    }
    files.write_atomically(out_dir, "step.hlo.pb", hlo_bytes)
    files.write_atomically(out_dir, "step.hlo.txt", hlo_text)
    artefact = None
    if portable:
        try:
            from tfllm.plan.jax_export import exported_step
            artefact = exported_step(hlo_bytes)
        except ImportError:  # no plan extra: the HLO alone (run_step.py then needs 0.10.2)
            pass
    description["jax_export"] = "step.jax" if artefact is not None else None
    if artefact is not None:
        files.write_atomically(out_dir, "step.jax", artefact)
    files.write_atomically(out_dir, "step.json", json.dumps(description, indent=1))
    if check:  # one step's inputs and TensorFlow's results, for the runner to match
        inputs = ([b.numpy() for b in flat] + [limit.numpy()]
                  + [var.numpy() for var in captured])
        result = step.compiled(batch, limit)
        arrays = {f"input/{i}": x for i, x in enumerate(inputs)}
        arrays.update({f"metric/{k}": np.asarray(v) for k, v in result.items()})
        arrays.update({f"update/{i}": captured[i - len(flat) - 1].numpy() for i in written})
        archive = io.BytesIO()
        np.savez(archive, **arrays)
        files.write_atomically(out_dir, "check.npz", archive.getvalue())
    return description
