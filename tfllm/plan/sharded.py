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

import math
from typing import Optional

from tfllm.footprint.layout import (ACT_BYTES, experts_split, gather_buffers, gradient_bytes,
                                    mesh_shape, state_bytes, weight_units)
from tfllm.parallel import rules as rules_lib
from tfllm.plan.timing import adamw_seconds

# NVLink 4 on H100/H200 SXM: 18 links x 25 GB/s per direction = 450 GB/s (XLA's specs list
# `active_links: 18`); NVLink 5 on B200: 900 GB/s; NVLink 3 on A100 SXM: 300 GB/s
# (NVIDIA's datasheets, per direction).
LINK_BANDWIDTH = {"h100": 450e9, "h200": 450e9, "b200": 900e9, "a100": 300e9}



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
    act = ACT_BYTES.get(config.precision.policy, 4)
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
