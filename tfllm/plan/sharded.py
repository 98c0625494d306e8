"""Planning one device of a sharded mesh, from the per-device shapes (an estimate).

What DTensor hands to XLA on a sharded mesh (measured in issue 16, see the README's "XLA
on a DTensor mesh"): not one per-device program but many XLA clusters per device (72 for
a tiny llama on 8 devices), split at every collective; the collectives themselves are
TensorFlow ops that run between the clusters, outside XLA. No single XLA program of a
sharded step exists to compile for a GPU, so a sharded mesh is planned as:

* **compute and temporaries**: the one-device step compiled with the shapes one device
  computes with: the batch divided over the mesh axes that carry it (rows, and the
  sequence when data and fsdp are both > 1: folded into rows where they divide), and under tensor
  parallelism the heads, key-value heads, MLP width and vocabulary divided over `model`;
* **state**: the exact per-device bytes of every weight, optimizer moment and FP8 history
  in its layout (`tfllm.parallel.layouts`), replacing the one-device program's copies;
* **collectives**: the bytes each device sends per step for the layout with ring
  algorithms (all-reduce 2(n-1)/n of the buffer, all-gather and reduce-scatter (n-1)/n of
  the gathered size), timed at the target's NVLink bandwidth, hidden behind compute as
  the blocks' prefetch allows (`tfllm.plan.timing.exposed_collective_seconds`):
  data: all-reduce of the gradients; fsdp: all-gather of the weights in the compute dtype
  (FP8 projections' kernels in one byte per value) forward and again backward,
  reduce-scatter of the float32 gradients; model: 4 all-reduces of the (B, T, E)
  activations per layer (attention and MLP outputs forward, their input gradients
  backward). These are the layout's theoretical minimum; DTensor's real programs may move
  more (relayouts it inserts are not modelled).
"""

from __future__ import annotations

import copy
import math
from typing import Dict, List, Optional, Tuple

from tfllm.parallel import rules as rules_lib
from tfllm.parallel.layouts import layout_rows, mesh_shape_from_config
from tfllm.parallel.mesh import parse_axes
from tfllm.plan.timing import adamw_seconds

# NVLink 4 on H100/H200 SXM: 18 links x 25 GB/s per direction = 450 GB/s (XLA's specs list
# `active_links: 18`); NVLink 5 on B200: 900 GB/s; NVLink 3 on A100 SXM: 300 GB/s
# (NVIDIA's datasheets, per direction).
LINK_BANDWIDTH = {"h100": 450e9, "h200": 450e9, "b200": 900e9, "a100": 300e9}

_ACT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 2}
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


def expert_all_to_all_bytes(config, local, n: int) -> float:
    """Bytes one device sends per step in expert parallelism's all-to-alls over n devices
    (`tfllm.models.common.moe`, docs/sharding.md): per sparse layer and micro-batch, the
    slots buffer (rows x E x C x D, 16-bit on the wire) goes to its experts and back in
    the forward pass and its gradient both ways in the backward (4 all-to-alls; 6 under
    model.remat=full, whose recomputation exchanges again), each sending (n - 1) / n."""
    from tfllm.families import is_moe_layer
    from tfllm.models.common.dispatch import expert_capacity
    m, t = config.model, local.train
    length = local.data.sequence_length
    capacity = expert_capacity(length, m.num_experts_per_tok, m.num_experts,
                               m.moe_capacity_factor or None)
    rows = t.global_batch_size / t.grad_accum_steps  # the device's micro-batch rows
    buffer = rows * m.num_experts * capacity * m.hidden_dim * 2
    sparse = sum(is_moe_layer(m, i) for i in range(m.num_layers))
    exchanges = 6 if m.remat == "full" else 4
    return sparse * t.grad_accum_steps * exchanges * (n - 1) / n * buffer


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
    c = _ACT_BYTES.get(config.precision.policy, 4)
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


def apply_mesh(config, local, result: dict, target, mesh_note: str, devices=None,
               measured: Optional[dict] = None, block: Optional[dict] = None) -> dict:
    """Turns the plan of `local`'s one-device program into the plan of one mesh device.

    Args:
      measured: the collectives measured on the executed CPU program
        (`tfllm.plan.measured.measure`); when given, they time the step and the
        layout's formula stays beside them as `collectives_assumed`.
      block: the compiled block program's memory (`tfllm.plan.block_program.
        block_memory`); when given, its block buffers are the ones counted and the
        model's (`gather_buffers`) stays beside them.
    """
    shape = mesh_shape(config, devices)
    devices = math.prod(shape.values())
    result["devices"] = devices
    result["mesh"] = mesh_note
    if devices == 1:
        return result
    one = {"data": 1}
    local_state, _ = state_bytes(local, one)
    mesh_state, rows = state_bytes(config, shape)
    mem = result["memory"]
    diff = mesh_state - local_state
    for key in ("arguments", "outputs", "alias"):
        mem[key] += diff
    buffers = gather_buffers(config, shape)
    mem["gather_buffers"] = buffers["bytes"]
    mem["gather_detail"] = {k: v for k, v in buffers.items() if k != "units"}
    counted = buffers["bytes"]
    if block is not None and buffers["bytes"]:
        mem["block_buffers"] = block["block_buffers"]
        mem["block_program"] = block
        counted = block["block_buffers"]
        if not str(buffers["unit"]).startswith("block_"):
            # the model's peak is the embedding's or the head's unit (a large vocabulary:
            # gpt2-small's 221 MiB against a block's compiled 54 MiB), which the block
            # program does not hold: the larger of the two is counted
            counted = max(counted, buffers["bytes"])
            mem["block_buffers_counted"] = counted
    grads = gradient_bytes(config, local, shape)
    mem["gradients"] = grads
    mem["total"] = (mem["arguments"] + mem["outputs"] - mem["alias"] + mem["temp"]
                    + counted - grads["subtracted"])
    if grads["subtracted"] == 0 and grads["excess"]:
        # one micro-batch: where in the backward pass the peak falls is not known from
        # the compile's total; the total stays the compile's (an upper bound) and the
        # bound with every excess byte gone is printed beside it
        mem["total_low"] = mem["total"] - grads["excess"]
    # model_flops, flops and tokens_per_step stay those of the local program: one
    # device's share of the step; the devices that split the batch multiply the tokens
    result["batch_shards"] = ((config.train.global_batch_size * config.data.sequence_length)
                              // (local.train.global_batch_size * local.data.sequence_length))
    act = _ACT_BYTES.get(config.precision.policy, 4)
    # float32 trainable variables: what gradients reduce (not FP8 histories, nor LoRA's
    # frozen kernels)
    # (expert parallelism's kernels excepted: their gradients are whole where they live)
    ep = experts_split(config, shape)
    weights_per_device = sum(r.bytes_per_device for r in rows if r.optimizer_bytes_per_device
                             and not (ep and "experts" in r.logical_axes))
    detail, sent = [], 0.0
    data, fsdp, tp = shape.get("data", 1), shape.get("fsdp", 1), shape.get("model", 1)
    if data > 1:
        b = 2 * (data - 1) / data * weights_per_device
        sent += b
        detail.append(f"data: all-reduce grads {b / 1e9:.2f} GB")
    if fsdp > 1:
        # Each unit's gather yields its weights full over fsdp: in the compute dtype, FP8
        # projections' kernels in one byte per value (`weight_units`).
        units = buffers["units"] or weight_units(config, shape)
        gathered = sum(act * (u["gathered"] - u["gathered_8bit"]) + u["gathered_8bit"]
                       for u in units)
        b_ag = 2 * (fsdp - 1) / fsdp * gathered
        b_rs = (fsdp - 1) / fsdp * weights_per_device * fsdp
        sent += b_ag + b_rs
        detail.append(f"fsdp: all-gather weights {b_ag / 1e9:.2f} GB, "
                      f"reduce-scatter grads {b_rs / 1e9:.2f} GB")
    batch = rules_lib.batch_layout(config.train.global_batch_size,
                                   config.train.grad_accum_steps, config.data.sequence_length,
                                   rules_lib.rules_from_config(config.mesh.rules), shape)
    seq_axis, row_axis = batch.sequence_axis, batch.rows_axis
    if seq_axis:
        # Attention gathers each layer's keys and values of its rows over the sequence
        # axis forward and reduce-scatters their gradients backward.
        seq, m = shape[seq_axis], config.model
        kv_width = (m.num_key_value_heads or m.num_query_heads) * (
            m.head_dim or m.hidden_dim // m.num_query_heads) // tp
        rows_per_device = config.train.global_batch_size // (shape[row_axis] if row_axis else 1)
        kv_bytes = rows_per_device * config.data.sequence_length * kv_width * act
        b = m.num_layers * 2 * 2 * (seq - 1) / seq * kv_bytes
        sent += b
        detail.append(f"{seq_axis} (sequence): all-gather keys/values, reduce-scatter "
                      f"their grads {b / 1e9:.2f} GB")
    if tp > 1:
        c = config
        tokens = local.train.global_batch_size * local.data.sequence_length
        b = 4 * c.model.num_layers * 2 * (tp - 1) / tp * tokens * c.model.hidden_dim * act
        sent += b
        detail.append(f"model: all-reduce activations {b / 1e9:.2f} GB")
    if ep:
        ep_axis = rules_lib.expert_axis(config.model.num_experts,
                                        rules_lib.rules_from_config(config.mesh.rules), shape)
        b = expert_all_to_all_bytes(config, local, shape[ep_axis])
        sent += b
        detail.append(f"{ep_axis} (experts): all-to-all dispatched tokens {b / 1e9:.2f} GB")
    bandwidth = LINK_BANDWIDTH[target.name]
    assumed = {"bytes_per_device": sent, "detail": "; ".join(detail),
               "link_bandwidth": bandwidth, "seconds": sent / bandwidth,
               "basis": "assumed: the layout's formula (ring algorithms)"}
    if measured is not None:
        result["collectives"] = measured
        result["collectives_assumed"] = assumed
    else:
        result["collectives"] = assumed
    result["collective_s"] = result["collectives"]["seconds"]
    # FSDP's and data parallelism's collectives move block by block, prefetched one block
    # ahead (tfllm.plan.timing.exposed_collective_seconds); tensor and sequence
    # parallelism's wait on the layer's own activations
    result["blocks"] = config.model.num_layers
    result["overlappable"] = tp == 1 and not seq_axis
    # Collectives per device per step: measured, else one per weight for each data-
    # parallel reduction, two gathers and a reduce-scatter per weight under FSDP, and four
    # activation all-reduces per layer under tensor parallelism. DTensor splits the
    # device's program into XLA clusters at each of them.
    trainable = sum(1 for r in rows if r.optimizer_bytes_per_device)
    count = (measured or {}).get("count") or (
        trainable * ((data > 1) + 3 * (fsdp > 1)) + 4 * config.model.num_layers * (tp > 1))
    result["collective_count"] = count
    if (measured or {}).get("clusters"):
        result["clusters"] = measured["clusters"]
        result["clusters_basis"] = measured["clusters_basis"]
    else:
        result["clusters"] = count + 1
    # The no-mesh program updates every weight it computes with; the layout updates the
    # device's shard of the optimizer state (AdamW's two float32 moments: 8 bytes/param).
    local_params = sum(r.optimizer_bytes_per_device for r in state_bytes(local, one)[1]) / 8
    shard_params = sum(r.optimizer_bytes_per_device for r in rows) / 8
    result["optimizer_update"] = {
        "program_params": local_params, "layout_params": shard_params,
        "program_s": adamw_seconds(local_params, target.memory_bandwidth),
        "layout_s": adamw_seconds(shard_params, target.memory_bandwidth)}
    result["method_note"] = ("estimate from per-device shapes: DTensor gives XLA many "
                             "clusters per device, not one program")
    return result
