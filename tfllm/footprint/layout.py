"""What one device of a mesh holds, from shapes and the rules table alone (no compile):
the per-device config a sharded step computes with, the state's exact bytes in its layout,
the weights that move together (FSDP's units and their gather buffers), and the float32
gradients a device keeps. `tfllm.footprint.fit` builds the memory-fit estimate on these;
`tfllm.plan.sharded` adds the collectives and times them for a GPU target.
"""

from __future__ import annotations

import copy
import math
from typing import Dict, List, Tuple

from tfllm.parallel import rules as rules_lib
from tfllm.parallel.layouts import layout_rows, mesh_shape_from_config
from tfllm.parallel.mesh import parse_axes

#: bytes per activation element of a precision policy (FP8 computes in bf16 between GEMMs)
ACT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 2}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8}


def mesh_shape(config, devices=None) -> Dict[str, int]:
    """The config's mesh; `devices` (default 1) sizes a -1 axis, fixed sizes stand."""
    has_free_axis = any(size == -1 for _, size in parse_axes(config.mesh.axes))
    return mesh_shape_from_config(config.mesh, (devices or 1) if has_free_axis else None)


def compute_sizes(config, shape) -> Dict[str, int]:
    """{variable path: elements of its compute layout} of the trainable weights: the full
    shape divided by the non-fsdp mesh axes it is split over (what a gather yields)."""
    from tfllm.models import build_model
    rows = layout_rows(build_model(config, allocate=False),
                       rules_lib.rules_from_config(config.mesh.rules), shape)
    out = {}
    for r in rows:
        if not r.optimizer_bytes_per_device:
            continue  # not trainable
        split = 1
        for axis in r.spec:
            for a in (axis if isinstance(axis, tuple) else (axis,)):
                if a and a != "fsdp":
                    split *= shape.get(a, 1)
        out[r.path] = math.prod(r.shape) // split
    return out


def per_device_config(config, devices=None) -> Tuple[object, str]:
    """(the config of what one device computes, a description of the mesh).

    Args:
      devices: the device count, used where a mesh axis is -1 (default 1).
    """
    shape = mesh_shape(config, devices)
    devices = math.prod(shape.values())
    local = copy.deepcopy(config)
    local.mesh.axes = "data=1"
    if devices == 1:
        return local, "one device"
    rules = rules_lib.rules_from_config(config.mesh.rules)
    m, t = config.model, config.train
    length = config.data.sequence_length
    batch = rules_lib.batch_layout(t.global_batch_size, t.grad_accum_steps, length, rules,
                                   shape)
    micro_rows, row_axis, seq_axis = batch.micro_batch_rows, batch.rows_axis, batch.sequence_axis
    rows, seq = shape[row_axis] if row_axis else 1, shape[seq_axis] if seq_axis else 1
    local.train.global_batch_size = t.global_batch_size // rows
    if seq > 1:
        if (micro_rows // rows) % seq == 0:
            # Sequence sharding: a device computes T/seq queries of B/rows rows against
            # all T keys: the same tokens and (queries x keys) scores as B/(rows*seq)
            # whole rows, which is what the one-device program is compiled with.
            local.train.global_batch_size //= seq
        else:
            # Too few rows to fold the sequence split into them: a (T/seq)-token program
            # (its attention sees T/seq keys, not T: scores are underestimated).
            local.data.sequence_length = length // seq
    tp_axis = rules_lib.candidate_axis("heads", rules, shape) or ""
    if tp_axis:
        tp = shape[tp_axis]
        lm = local.model
        lm.head_dim = m.head_dim or m.hidden_dim // m.num_query_heads
        lm.num_query_heads = m.num_query_heads // tp
        lm.num_key_value_heads = (m.num_key_value_heads or m.num_query_heads) // tp
        lm.intermediate_dim = m.intermediate_dim // tp
        lm.moe_intermediate_dim = m.moe_intermediate_dim // tp  # experts' mlp axis too
        lm.vocab_size = m.vocab_size // tp
    desc = ", ".join(f"{k}={v}" for k, v in shape.items())
    return local, f"{desc} ({devices} devices), per device"


def state_bytes(config, shape):
    """(bytes of all state per device, the layout rows)."""
    from tfllm.models import build_model
    rows = layout_rows(build_model(config, allocate=False),
                       rules_lib.rules_from_config(config.mesh.rules), shape,
                       config.optimizer.shard_optimizer_state)
    return sum(r.bytes_per_device + r.optimizer_bytes_per_device for r in rows), rows


def param_count(config) -> int:
    """Trainable parameters of the config's model, from shapes only."""
    from tfllm.models import build_model
    model = build_model(config, allocate=False)
    return sum(math.prod(int(d) for d in v.shape) for v in model.trainable_variables)


def _mesh_axes(spec):
    """The mesh axes of a spec, flattened (a dimension may name a tuple of axes)."""
    return [a for axis in spec for a in (axis if isinstance(axis, tuple) else (axis,)) if a]


def experts_split(config, shape) -> bool:
    """Whether the layout splits the experts over a mesh axis (expert parallelism: their
    kernels stay where they are, tokens travel by all-to-all instead)."""
    if not config.model.num_experts:
        return False
    axis = rules_lib.expert_axis(config.model.num_experts,
                                 rules_lib.rules_from_config(config.mesh.rules), shape)
    return bool(axis) and shape[axis] > 1


def weight_units(config, shape) -> List[dict]:
    """The groups of weights that move together on one device, in forward order, with
    their sizes: what `tfllm.models.causal_lm` hands to `tfllm.parallel.blocks`.

    The token embedding is gathered on its own (`tfllm.parallel.fsdp`, outside any
    block); each transformer block's trainable weights are one block; the final norm
    and the head are one block (a tied head gathers the embedding table again, per
    weight, inside it).

    Frozen weights (LoRA's base kernels) travel in their block's gather but get no
    gradient; FP8 projections' kernels travel as one byte per value where the policy
    gathers them in FP8 (`precision.fp8_gather`, `tfllm.precision.fp8.WeightCodec`).

    Returns:
      [{"name", "gathered": elements of the unit's weights sharded over a batch axis, in
        their compute layout (what its gather yields on one device), "gathered_8bit": of
        those, the elements that travel as FP8 bytes, "reduced": elements of all its
        trainable weights in their compute layout (its per-device partial gradients,
        reduced as one float32 buffer)}].
    """
    from tfllm.models import build_model
    model = build_model(config, allocate=False)
    rules = rules_lib.rules_from_config(config.mesh.rules)
    batch_axes = rules_lib.activation_mesh_axes(rules)
    rows = {r.path: r for r in layout_rows(model, rules, shape)}

    expert_parallel = experts_split(config, shape)

    def unit(name, variables):
        gathered = gathered_8bit = reduced = 0
        for v in variables:
            r = rows[v.path]
            if expert_parallel and "experts" in r.logical_axes:
                continue  # computed where they live: never gathered nor block-reduced
            axes = _mesh_axes(r.spec)
            n = math.prod(r.shape) // math.prod(
                shape.get(a, 1) for a in axes if a not in batch_axes)
            if v.trainable:
                reduced += n
            if any(a in batch_axes and shape.get(a, 1) > 1 for a in axes):
                gathered += n
                if getattr(v, "gather_codec", None) is not None:  # fp8 with fp8_gather
                    gathered_8bit += n
        return {"name": name, "gathered": gathered, "gathered_8bit": gathered_8bit,
                "reduced": reduced}

    def weights(layer):  # what `tfllm.parallel.context.block_weights` hands a block
        return [v for v in layer.weights
                if v.trainable or getattr(v, "kind", "fp8_state") != "fp8_state"]

    table = model.token_embedding.trainable_variables
    head = model.final_norm.trainable_variables + (
        table if model.lm_head is None else model.lm_head.trainable_variables)
    return ([unit("token_embedding", table)]
            + [unit(b.name, weights(b)) for b in model.blocks]
            + [unit("final_norm + head", head)])


def has_blocks(config, shape) -> bool:
    """Whether the mesh splits the batch (a data or fsdp axis above 1): then the model's
    weights move block by block (`tfllm.parallel.blocks`)."""
    rules = rules_lib.rules_from_config(config.mesh.rules)
    return any(shape.get(a, 1) > 1 for a in rules_lib.activation_mesh_axes(rules))


def gather_buffers(config, shape) -> dict:
    """Bytes of the weight and gradient buffers of `tfllm.parallel.blocks` on one
    device: a model of what the block schedule keeps alive, not a measurement.

    Blocks exist when the batch is split (a data or fsdp axis above 1). With c the
    compute dtype's bytes, g a unit's gathered and r its reduced elements
    (`weight_units`):

    * forward, while unit i computes: its gathered weights and those of unit i+1,
      gathered one unit ahead: c (g_i + g_i+1);
    * backward, while unit i reduces its gradients: the re-gather of unit i-1, prefetched;
      unit i's per-device partial gradients in the compute dtype; and the float32
      buffer its one reduce-scatter (or bucketed all-reduce) sends: c g_i-1 + (c + 4) r_i.

    The peak is the larger over all units. Under NCCL the reduce-scatter's output is the
    shard (already counted with the gradients); on CPU devices DTensor runs it as an
    all-reduce and a slice, with a full float32 output more (not counted here).

    Returns:
      {"bytes", "gathered": c x the two units' gathered weights at the peak,
       "gradient": the float32 buffer at the peak, "partials": the compute-dtype partial
       gradients at the peak, "unit": the unit and phase of the peak, "units": the units}.
    """
    if not has_blocks(config, shape):
        return {"bytes": 0, "gathered": 0, "gradient": 0, "partials": 0, "unit": None,
                "units": []}
    c = ACT_BYTES.get(config.precision.policy, 4)
    units = weight_units(config, shape)
    g = [u["gathered"] for u in units] + [0]  # g[-1]: nothing before the first unit
    phases = []
    for i, u in enumerate(units):
        phases.append({"gathered": c * (g[i] + g[i + 1]), "gradient": 0, "partials": 0,
                       "unit": f"{u['name']} forward"})
        phases.append({"gathered": c * g[i - 1], "gradient": 4 * u["reduced"],
                       "partials": c * u["reduced"], "unit": f"{u['name']} backward"})
    peak = max(phases, key=lambda p: p["gathered"] + p["gradient"] + p["partials"])
    return dict(peak, bytes=peak["gathered"] + peak["gradient"] + peak["partials"],
                units=units)


def _trainable_gradient_bytes(rows) -> int:
    """Float32 gradient bytes of the trainable variables of layout rows (a variable's
    gradient is laid out as the variable: float32, its shard on a sharded mesh)."""
    out = 0
    for r in rows:
        if r.optimizer_bytes_per_device:  # trainable: AdamW keeps moments for it
            out += r.bytes_per_device * 4 // _DTYPE_BYTES.get(r.dtype, 4)
    return out


def gradient_bytes(config, local, shape) -> dict:
    """The float32 gradients of the no-mesh program against a mesh device's.

    The plan compiles the one-device step at one device's shapes (`per_device_config`):
    its weights are whole over fsdp, so its gradients are too, and the step keeps them
    (`tfllm.train.step`: a running sum over the micro-batches, then the global-norm clip
    and the update). A mesh device keeps each gradient in its variable's layout: the
    shard its block's reduce-scatter yields (1/fsdp of it; a data axis keeps it whole).
    The difference is the compile's excess.

    Under gradient accumulation it comes off the compiled total: every micro-batch
    after the first runs with the earlier ones' gradients alive (for each variable its
    running sum, or the gradients it will sum: at least one whole float32 set), so at
    each of its points the program holds at least the excess more than a mesh device;
    and a point of the first micro-batch holds on the device no more than the same
    point of the next (the same activations, fewer gradients). The device's peak is
    then at most the compiled total less the excess: exact where one set is alive at
    the compiled peak, an upper bound where XLA keeps more (fused sums over several
    micro-batches keep each one's gradients: the compiled H100 step of the tests' tiny
    llama keeps 0.995 of a set more temporaries with 4 micro-batches than with 2,
    benchmarks/results/h100_plan.md, 2026-11-29). With one
    micro-batch the gradients grow while the backward pass frees activations, and the
    compile's total does not say how many were alive at its peak: nothing is subtracted
    (the total is an upper bound) and `total_low`, all of the excess subtracted, is its
    lower bound.

    Returns:
      {"program": float32 gradient bytes of the compiled program's trainable variables,
       "device": a mesh device's (in their layouts), "excess": program - device,
       "subtracted": the excess taken off the total (0 with one micro-batch)}.
    """
    program = _trainable_gradient_bytes(state_bytes(local, {"data": 1})[1])
    device = _trainable_gradient_bytes(state_bytes(config, shape)[1])
    excess = max(program - device, 0)
    return {"program": program, "device": device, "excess": excess,
            "subtracted": excess if config.train.grad_accum_steps > 1 else 0}
