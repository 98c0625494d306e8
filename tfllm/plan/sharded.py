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

import dataclasses
from typing import Any, Mapping, Optional, Tuple

from tfllm.footprint.layout import BlockBuffers, Gradients, MeshPlan, gradients
from tfllm.plan.timing import adamw_seconds

# NVLink 4 on H100/H200 SXM: 18 links x 25 GB/s per direction = 450 GB/s (XLA's specs list
# `active_links: 18`); NVLink 5 on B200: 900 GB/s; NVLink 3 on A100 SXM: 300 GB/s
# (NVIDIA's datasheets, per direction).
LINK_BANDWIDTH = {"h100": 450e9, "h200": 450e9, "b200": 900e9, "a100": 300e9}

#: the basis of collectives from the layout's formula
ASSUMED = "assumed: the layout's formula (ring algorithms)"


@dataclasses.dataclass(frozen=True)
class AxisTraffic:
    """What one device sends per step for one job of one mesh axis (`axis_traffic`).

    Attributes:
      axis: the mesh axis, with the job's kind where it is not the axis' own ("fsdp
        (sequence)", "data (experts)").
      what: the collective and what it carries ("all-reduce grads").
      bytes: bytes one device sends per step (ring algorithms).
    """
    axis: str
    what: str
    bytes: float


def describe(traffic: Tuple[AxisTraffic, ...]) -> str:
    """"data: all-reduce grads 1.20 GB; fsdp: all-gather weights 0.8 GB, ..." (the
    jobs of one axis together, in order)."""
    parts, last = [], None
    for t in traffic:
        text = f"{t.what} {t.bytes / 1e9:.2f} GB"
        if t.axis == last:
            parts[-1] += f", {text}"
        else:
            parts.append(f"{t.axis}: {text}")
        last = t.axis
    return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Collectives:
    """A device's collectives per step, and the time they take at the link's bandwidth.

    Attributes:
      bytes_per_device: bytes one device sends per step.
      seconds: bytes_per_device / link_bandwidth.
      link_bandwidth: the target's link bandwidth, bytes/s per direction.
      basis: where the figures come from ("assumed: ..." or "measured: ...").
      detail: the bytes by axis and job, in words.
      traffic: the layout formula's jobs (assumed collectives; empty when measured).
      measured: the measurement's other figures (`tfllm.plan.measured.measure`: count,
        clusters, groups, tiny runs), empty when assumed.
    """
    bytes_per_device: float
    seconds: float
    link_bandwidth: float
    basis: str
    detail: str
    traffic: Tuple[AxisTraffic, ...] = ()
    measured: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def assumed(cls, traffic: Tuple[AxisTraffic, ...], link_bandwidth: float,
                note: str = "") -> "Collectives":
        sent = sum(t.bytes for t in traffic)
        return cls(sent, sent / link_bandwidth, link_bandwidth, ASSUMED + note,
                   describe(traffic), tuple(traffic))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Collectives":
        core = ("bytes_per_device", "seconds", "link_bandwidth", "basis", "detail")
        traffic = tuple(AxisTraffic(**t) for t in d.get("traffic", ()))
        return cls(*(d[k] for k in core), traffic=traffic,
                   measured={k: v for k, v in d.items() if k not in core + ("traffic",)})

    def as_json(self) -> dict:
        out = {"bytes_per_device": self.bytes_per_device, "detail": self.detail,
               "link_bandwidth": self.link_bandwidth, "seconds": self.seconds,
               "basis": self.basis, **self.measured}
        if self.traffic:
            out["traffic"] = [dataclasses.asdict(t) for t in self.traffic]
        return out


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


def axis_traffic(plan: MeshPlan, config) -> Tuple[AxisTraffic, ...]:
    """The bytes one device sends per step for each mesh axis' job, by the layout's
    formula (ring algorithms: an all-reduce sends 2(n-1)/n of its buffer, an all-gather
    and a reduce-scatter (n-1)/n of the gathered size). Pure arithmetic on the plan.

    data: all-reduce of the gradients; fsdp: all-gather of the weights in the compute
    dtype (FP8 projections' kernels in one byte per value) forward and again backward,
    reduce-scatter of the float32 gradients; a sequence axis: all-gather of each layer's
    keys and values forward, reduce-scatter of their gradients backward; model: 4
    all-reduces of the (B, T, E) activations per layer; experts: the all-to-alls of the
    dispatched tokens (`expert_all_to_all_bytes`).
    """
    shape, act, m = plan.shape, plan.compute_bytes, config.model
    # float32 trainable variables: what gradients reduce (not FP8 histories, nor LoRA's
    # frozen kernels; nor expert parallelism's kernels: their gradients are whole where
    # they live)
    weights = sum(r.bytes_per_device for r in plan.rows if r.optimizer_bytes_per_device
                  and not (plan.experts_split and "experts" in r.logical_axes))
    data, fsdp, tp = shape.get("data", 1), shape.get("fsdp", 1), shape.get("model", 1)
    out = []
    if data > 1:
        out.append(AxisTraffic("data", "all-reduce grads", 2 * (data - 1) / data * weights))
    if fsdp > 1:
        # Each unit's gather yields its weights full over fsdp: in the compute dtype, FP8
        # projections' kernels in one byte per value.
        gathered = sum(act * (u.gathered - u.gathered_8bit) + u.gathered_8bit
                       for u in plan.units)
        out.append(AxisTraffic("fsdp", "all-gather weights",
                               2 * (fsdp - 1) / fsdp * gathered))
        out.append(AxisTraffic("fsdp", "reduce-scatter grads",
                               (fsdp - 1) / fsdp * weights * fsdp))
    seq_axis, row_axis = plan.batch.sequence_axis, plan.batch.rows_axis
    if seq_axis:
        seq = shape[seq_axis]
        kv_width = (m.num_key_value_heads or m.num_query_heads) * (
            m.head_dim or m.hidden_dim // m.num_query_heads) // tp
        rows = config.train.global_batch_size // (shape[row_axis] if row_axis else 1)
        kv_bytes = rows * config.data.sequence_length * kv_width * act
        out.append(AxisTraffic(f"{seq_axis} (sequence)",
                               "all-gather keys/values, reduce-scatter their grads",
                               m.num_layers * 2 * 2 * (seq - 1) / seq * kv_bytes))
    if tp > 1:
        local = plan.local
        tokens = local.train.global_batch_size * local.data.sequence_length
        out.append(AxisTraffic("model", "all-reduce activations",
                               4 * m.num_layers * 2 * (tp - 1) / tp * tokens
                               * m.hidden_dim * act))
    if plan.experts_split:
        out.append(AxisTraffic(f"{plan.expert_axis} (experts)",
                               "all-to-all dispatched tokens",
                               expert_all_to_all_bytes(config, plan.local,
                                                       shape[plan.expert_axis])))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class MeshMemory:
    """What a mesh device holds that the one-device program's compile does not say.

    Attributes:
      state_difference: the layout's state bytes less the program's (its weights whole,
        its moments unsharded): added to the compile's arguments, outputs and aliases.
      gradients: the program's float32 gradients against the device's (`gradients`).
      buffers: the block schedule's buffers, modelled (`MeshPlan.buffers`).
      block_program: the compiled block program's memory (`tfllm.plan.block_program.
        block_memory`), None when not compiled.
      block_buffers: the compiled block program's block buffers, None when not compiled.
      counted: the block buffers the total counts (the compiled ones, or the model's
        where its peak unit is not a block: the embedding's or the head's).
    """
    state_difference: int
    gradients: Gradients
    buffers: BlockBuffers
    block_program: Optional[Mapping[str, Any]]
    block_buffers: Optional[int]
    counted: int


@dataclasses.dataclass(frozen=True)
class MeshFigures:
    """One device of a mesh, beside the one-device program's compile (`mesh_figures`).

    Attributes:
      devices: the mesh's device count.
      note: the mesh in words.
      memory: what the device holds beyond the compile (`MeshMemory`).
      collectives: the collectives that time the step (measured, else assumed).
      collectives_assumed: the layout's formula, when measured ones time the step.
      collective_count: collectives per device per step.
      clusters: XLA clusters per device per step.
      clusters_basis: where `clusters` comes from (None: one per collective + 1).
      blocks: the blocks whose collectives are prefetched one ahead.
      overlappable: whether the collectives may run beside compute (FSDP and data
        parallelism's; tensor and sequence parallelism's wait on their activations).
      batch_shards: the devices that split the batch (tokens per step multiply by it).
      optimizer_update: the AdamW update of the program's parameters against the
        layout's shard (parameters and seconds of each).
    """
    devices: int
    note: str
    memory: MeshMemory
    collectives: Collectives
    collectives_assumed: Optional[Collectives]
    collective_count: int
    clusters: int
    clusters_basis: Optional[str]
    blocks: int
    overlappable: bool
    batch_shards: int
    optimizer_update: Mapping[str, float]


def mesh_figures(config, plan: MeshPlan, program: MeshPlan, target,
                 measured: Optional[dict] = None,
                 block: Optional[dict] = None) -> MeshFigures:
    """The figures of one mesh device that the one-device program's compile lacks.

    Args:
      config: the config planned.
      plan: its `MeshPlan` (devices > 1).
      program: the `MeshPlan` of the one-device program (`plan.local` on one device).
      target: the GPU target.
      measured: the collectives measured on the executed CPU program
        (`tfllm.plan.measured.measure`); when given, they time the step and the
        layout's formula stays beside them as `collectives_assumed`.
      block: the compiled block program's memory (`tfllm.plan.block_program.
        block_memory`); when given, its block buffers are the ones counted and the
        model's (`MeshPlan.buffers`) stays beside them.
    """
    buffers = plan.buffers
    counted, block_buffers = buffers.bytes, None
    if block is not None and buffers.bytes:
        block_buffers = counted = block["block_buffers"]
        if not str(buffers.unit).startswith("block_"):
            # the model's peak is the embedding's or the head's unit (a large vocabulary:
            # gpt2-small's 221 MiB against a block's compiled 54 MiB), which the block
            # program does not hold: the larger of the two is counted
            counted = max(counted, buffers.bytes)
    memory = MeshMemory(state_difference=plan.state_bytes - program.state_bytes,
                        gradients=gradients(plan, program), buffers=buffers,
                        block_program=block if block_buffers is not None else None,
                        block_buffers=block_buffers, counted=counted)
    bandwidth = LINK_BANDWIDTH[target.name]
    note = (" (a mixture of experts: not measured, tfllm.plan.measured scales dense "
            "weights only)" if config.model.num_experts else "")
    assumed = Collectives.assumed(axis_traffic(plan, config), bandwidth, note)
    collectives = Collectives.from_json(measured) if measured is not None else assumed
    shape = plan.shape
    data, fsdp, tp = shape.get("data", 1), shape.get("fsdp", 1), shape.get("model", 1)
    # Collectives per device per step: measured, else one per weight for each data-
    # parallel reduction, two gathers and a reduce-scatter per weight under FSDP, and four
    # activation all-reduces per layer under tensor parallelism. DTensor splits the
    # device's program into XLA clusters at each of them.
    trainable = sum(1 for r in plan.rows if r.optimizer_bytes_per_device)
    count = (measured or {}).get("count") or (
        trainable * ((data > 1) + 3 * (fsdp > 1)) + 4 * config.model.num_layers * (tp > 1))
    clusters_basis = (measured or {}).get("clusters_basis") if (measured or {}).get(
        "clusters") else None
    # The no-mesh program updates every weight it computes with; the layout updates the
    # device's shard of the optimizer state (AdamW's two float32 moments: 8 bytes/param).
    program_params = sum(r.optimizer_bytes_per_device for r in program.rows) / 8
    shard_params = sum(r.optimizer_bytes_per_device for r in plan.rows) / 8
    local = plan.local
    return MeshFigures(
        devices=plan.devices, note=plan.note, memory=memory, collectives=collectives,
        collectives_assumed=assumed if measured is not None else None,
        collective_count=count,
        clusters=measured["clusters"] if clusters_basis else count + 1,
        clusters_basis=clusters_basis,
        blocks=config.model.num_layers,
        # FSDP's and data parallelism's collectives move block by block, prefetched one
        # block ahead (tfllm.plan.timing.exposed_collective_seconds); tensor and sequence
        # parallelism's wait on the layer's own activations
        overlappable=tp == 1 and not plan.batch.sequence_axis,
        batch_shards=((config.train.global_batch_size * config.data.sequence_length)
                      // (local.train.global_batch_size * local.data.sequence_length)),
        optimizer_update={
            "program_params": program_params, "layout_params": shard_params,
            "program_s": adamw_seconds(program_params, target.memory_bandwidth),
            "layout_s": adamw_seconds(shard_params, target.memory_bandwidth)})
