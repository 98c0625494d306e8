"""What one device of a mesh holds, from shapes and the rules table alone (no compile).

`mesh_plan` works it out once per config and mesh, as a `MeshPlan` value: the mesh's
shape, the rules table, the batch's layout, the per-device config a sharded step
computes with, every variable's layout row (the state's exact bytes), the weights that
move together (FSDP's units, `WeightUnit`) and their gather buffers (`BlockBuffers`),
and the axis the experts split over. Everything below reads that value; nothing
rebuilds the rules or the model. `tfllm.footprint.fit` builds the memory-fit estimate
on it; `tfllm.plan.sharded` adds the collectives and times them for a GPU target.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Dict, Mapping, Optional, Tuple

from tfllm.parallel import rules as rules_lib
from tfllm.parallel.layouts import Row, layout_rows, mesh_shape_from_config
from tfllm.parallel.mesh import parse_axes

#: bytes per activation element of a precision policy (FP8 computes in bf16 between GEMMs)
ACT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 2}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8}


def mesh_shape(config, devices=None) -> Dict[str, int]:
    """The config's mesh; `devices` (default 1) sizes a -1 axis, fixed sizes stand."""
    has_free_axis = any(size == -1 for _, size in parse_axes(config.mesh.axes))
    return mesh_shape_from_config(config.mesh, (devices or 1) if has_free_axis else None)


@dataclasses.dataclass(frozen=True)
class WeightUnit:
    """Weights that move together on one device (`tfllm.parallel.blocks`' unit).

    Attributes:
      name: "token_embedding", a block's name, or "final_norm + head".
      gathered: elements of its weights sharded over a batch axis, in their compute
        layout (what its gather yields on one device).
      gathered_8bit: of those, the elements that travel as FP8 bytes.
      reduced: elements of all its trainable weights in their compute layout (its
        per-device partial gradients, reduced as one float32 buffer).
    """
    name: str
    gathered: int
    gathered_8bit: int
    reduced: int


@dataclasses.dataclass(frozen=True)
class BlockBuffers:
    """The peak of the block schedule's weight and gradient buffers (`MeshPlan.buffers`).

    Attributes:
      bytes: gathered + gradient + partials.
      gathered: compute-dtype bytes of the two units' gathered weights at the peak.
      gradient: the float32 reduction buffer at the peak.
      partials: the compute-dtype partial gradients at the peak.
      unit: the unit and phase of the peak (None without blocks).
    """
    bytes: int = 0
    gathered: int = 0
    gradient: int = 0
    partials: int = 0
    unit: Optional[str] = None

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """One device of a config's mesh, worked out once (`mesh_plan`).

    Attributes:
      shape: mesh axis -> size.
      rules: the rules table the layout follows.
      batch: how the training batch lies on the mesh (`rules.batch_layout`).
      local: the config of what one device computes (`per_device_config`): the batch,
        heads, widths and vocabulary of one device; its mesh is one device.
      note: the mesh in words ("fsdp=8 (8 devices), per device" or "one device").
      rows: every variable's layout row (`tfllm.parallel.layouts.Row`).
      units: the weights that move together, in forward order.
      expert_axis: the mesh axis the experts split over, None without expert parallelism.
      compute_bytes: bytes per element of the compute dtype (gathers, activations).
      grad_accum_steps: train.grad_accum_steps.
    """
    shape: Mapping[str, int]
    rules: rules_lib.Rules
    batch: rules_lib.BatchLayout
    local: object
    note: str
    rows: Tuple[Row, ...]
    units: Tuple[WeightUnit, ...]
    expert_axis: Optional[str]
    compute_bytes: int
    grad_accum_steps: int

    @property
    def devices(self) -> int:
        return math.prod(self.shape.values())

    @property
    def state_bytes(self) -> int:
        """Bytes of all state per device: weights, optimizer moments, FP8 histories."""
        return sum(r.bytes_per_device + r.optimizer_bytes_per_device for r in self.rows)

    @property
    def gradient_bytes(self) -> int:
        """Float32 gradient bytes of the trainable variables (a gradient is laid out as
        its variable: float32, the device's shard on a sharded mesh)."""
        return _trainable_gradient_bytes(self.rows)

    @property
    def has_blocks(self) -> bool:
        """Whether the mesh splits the batch (a data or fsdp axis above 1): then the
        model's weights move block by block (`tfllm.parallel.blocks`)."""
        return any(self.shape.get(a, 1) > 1
                   for a in rules_lib.activation_mesh_axes(self.rules))

    @property
    def experts_split(self) -> bool:
        """Whether the layout splits the experts over a mesh axis (expert parallelism:
        their kernels stay where they are, tokens travel by all-to-all instead)."""
        return bool(self.expert_axis) and self.shape[self.expert_axis] > 1

    @functools.cached_property
    def buffers(self) -> BlockBuffers:
        """Bytes of the weight and gradient buffers of `tfllm.parallel.blocks` on one
        device: a model of what the block schedule keeps alive, not a measurement.

        Blocks exist when the batch is split (a data or fsdp axis above 1). With c the
        compute dtype's bytes, g a unit's gathered and r its reduced elements:

        * forward, while unit i computes: its gathered weights and those of unit i+1,
          gathered one unit ahead: c (g_i + g_i+1);
        * backward, while unit i reduces its gradients: the re-gather of unit i-1,
          prefetched; unit i's per-device partial gradients in the compute dtype; and
          the float32 buffer its one reduce-scatter (or bucketed all-reduce) sends:
          c g_i-1 + (c + 4) r_i.

        The peak is the larger over all units. Under NCCL the reduce-scatter's output
        is the shard (already counted with the gradients); on CPU devices DTensor runs
        it as an all-reduce and a slice, with a full float32 output more (not counted).
        """
        if not self.has_blocks:
            return BlockBuffers()
        c = self.compute_bytes
        g = [u.gathered for u in self.units] + [0]  # g[-1]: nothing before the first unit
        phases = []
        for i, u in enumerate(self.units):
            phases.append(BlockBuffers(c * (g[i] + g[i + 1]), c * (g[i] + g[i + 1]), 0, 0,
                                       f"{u.name} forward"))
            gathered, gradient, partials = c * g[i - 1], 4 * u.reduced, c * u.reduced
            phases.append(BlockBuffers(gathered + gradient + partials, gathered, gradient,
                                       partials, f"{u.name} backward"))
        return max(phases, key=lambda p: p.bytes)

    def full_sizes(self) -> Dict[str, int]:
        """{variable path: elements of its whole shape} of the trainable weights."""
        return {r.path: math.prod(r.shape) for r in self.rows
                if r.optimizer_bytes_per_device}

    def compute_sizes(self) -> Dict[str, int]:
        """{variable path: elements of its compute layout} of the trainable weights: the
        full shape divided by the non-fsdp mesh axes it is split over (what a gather
        yields)."""
        out = {}
        for r in self.rows:
            if not r.optimizer_bytes_per_device:
                continue  # not trainable
            split = math.prod(self.shape.get(a, 1) for a in _mesh_axes(r.spec)
                              if a != "fsdp")
            out[r.path] = math.prod(r.shape) // split
        return out


def mesh_plan(config, devices=None) -> MeshPlan:
    """The `MeshPlan` of `config` on `devices` devices (the count a -1 mesh axis takes,
    default 1): the model is built once, abstract (no weights allocated), and the rules
    table resolved once.

    Raises:
      MeshError, ShardingError: the mesh, batch or experts do not fit the rules (one line).
    """
    from tfllm.models import build_model
    shape = mesh_shape(config, devices)
    axes = _MeshAxes.of(config, shape)
    local, note = _per_device(config, shape, axes)
    model = build_model(config.model, config.precision, config.lora, allocate=False)
    rows = tuple(layout_rows(model, axes.rules, shape, config.optimizer.shard_optimizer_state))
    split = bool(axes.experts) and shape[axes.experts] > 1
    return MeshPlan(shape=shape, rules=axes.rules, batch=axes.batch, local=local, note=note,
                    rows=rows, units=_weight_units(model, rows, axes.batch_axes, shape, split),
                    expert_axis=axes.experts,
                    compute_bytes=ACT_BYTES.get(config.precision.policy, 4),
                    grad_accum_steps=config.train.grad_accum_steps)


def per_device_config(config, devices=None) -> Tuple[object, str]:
    """(the config of what one device computes, a description of the mesh), without
    building the model (`mesh_plan` holds both with the layout).

    Args:
      devices: the device count, used where a mesh axis is -1 (default 1).
    """
    shape = mesh_shape(config, devices)
    return _per_device(config, shape, _MeshAxes.of(config, shape))


@dataclasses.dataclass(frozen=True)
class _MeshAxes:
    """What the rules table says of a config on a mesh, asked once: the rules, the batch's
    layout, the axes that split the heads (tensor parallelism) and the experts, and the
    axes a batch's activations are split over."""
    rules: rules_lib.Rules
    batch: rules_lib.BatchLayout
    heads: str
    experts: Optional[str]
    batch_axes: frozenset

    @staticmethod
    def of(config, shape) -> "_MeshAxes":
        rules = tuple(rules_lib.rules_from_config(config.mesh.rules))
        t, m = config.train, config.model
        return _MeshAxes(
            rules=rules,
            batch=rules_lib.batch_layout(t.global_batch_size, t.grad_accum_steps,
                                         config.data.sequence_length, rules, shape),
            heads=rules_lib.candidate_axis("heads", rules, shape) or "",
            experts=(rules_lib.expert_axis(m.num_experts, rules, shape)
                     if m.num_experts else None),
            batch_axes=frozenset(rules_lib.activation_mesh_axes(rules)))


def _per_device(config, shape, axes: _MeshAxes) -> Tuple[object, str]:
    devices = math.prod(shape.values())
    local = copy.deepcopy(config)
    local.mesh.axes = "data=1"
    if devices == 1:
        return local, "one device"
    m, t = config.model, config.train
    length = config.data.sequence_length
    batch = axes.batch
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
    if axes.heads:
        tp = shape[axes.heads]
        lm = local.model
        lm.head_dim = m.head_dim or m.hidden_dim // m.num_query_heads
        lm.num_query_heads = m.num_query_heads // tp
        lm.num_key_value_heads = (m.num_key_value_heads or m.num_query_heads) // tp
        lm.intermediate_dim = m.intermediate_dim // tp
        lm.moe_intermediate_dim = m.moe_intermediate_dim // tp  # experts' mlp axis too
        lm.vocab_size = m.vocab_size // tp
    if axes.experts and shape[axes.experts] > 1:
        _experts_of_one_device(local.model, m, shape[axes.experts], local.data.sequence_length)
    desc = ", ".join(f"{k}={v}" for k, v in shape.items())
    return local, f"{desc} ({devices} devices), per device"


def _experts_of_one_device(local_model, m, n: int, length: int) -> None:
    """Gives the per-device model the experts one device of expert parallelism holds.

    Over n devices a device holds E/n experts and, after the all-to-all, computes every
    row's tokens routed to them: a (B, E/n, C, D) buffer. The program at one device's
    shapes has B/n rows; with E/n experts its capacity cf T k / (E/n) is n C slots (up
    to rounding), so its (B/n, E/n, n C, D) buffer holds as many slots and costs the
    same expert FLOPs, while its weights, gradients and moments are the device's E/n
    experts, not all E (with all E, Qwen3-30B-A3B's program held 114 GiB of float32
    gradients that a device of fsdp=8 does not). Its router scores E/n experts, not E:
    112 logits less per token and layer for Qwen3-30B-A3B, 0.2% of the layer's
    activations. Kept at E when that cannot hold:
    dropless slots (C = T, no factor to scale), k above E/n, or n C above T.
    """
    from tfllm.models.common.dispatch import expert_capacity
    k, e = m.num_experts_per_tok, m.num_experts
    if not m.moe_capacity_factor or k > e // n:
        return
    if n * expert_capacity(length, k, e, m.moe_capacity_factor) > length:
        return
    local_model.num_experts = e // n


def param_count(config) -> int:
    """Trainable parameters of the config's model, from shapes only."""
    from tfllm.models import build_model
    model = build_model(config.model, config.precision, config.lora, allocate=False)
    return sum(math.prod(int(d) for d in v.shape) for v in model.trainable_variables)


def _mesh_axes(spec):
    """The mesh axes of a spec, flattened (a dimension may name a tuple of axes)."""
    return [a for axis in spec for a in (axis if isinstance(axis, tuple) else (axis,)) if a]


def _weight_units(model, rows, batch_axes, shape, expert_parallel: bool) -> Tuple[WeightUnit, ...]:
    """The groups of weights that move together on one device, in forward order, with
    their sizes: what `tfllm.models.causal_lm` hands to `tfllm.parallel.blocks`.

    The token embedding is gathered on its own (`tfllm.parallel.fsdp`, outside any
    block); each transformer block's trainable weights are one block; the final norm
    and the head are one block (a tied head gathers the embedding table again, per
    weight, inside it).

    Frozen weights (LoRA's base kernels) travel in their block's gather but get no
    gradient; FP8 projections' kernels travel as one byte per value where the policy
    gathers them in FP8 (`precision.fp8_gather`, `tfllm.precision.fp8.WeightCodec`).
    Expert-parallel kernels are computed where they live: never gathered nor reduced.
    """
    by_path = {r.path: r for r in rows}

    def unit(name, variables):
        gathered = gathered_8bit = reduced = 0
        for v in variables:
            r = by_path[v.path]
            if expert_parallel and "experts" in r.logical_axes:
                continue
            axes = _mesh_axes(r.spec)
            n = math.prod(r.shape) // math.prod(
                shape.get(a, 1) for a in axes if a not in batch_axes)
            if v.trainable:
                reduced += n
            if any(a in batch_axes and shape.get(a, 1) > 1 for a in axes):
                gathered += n
                if getattr(v, "gather_codec", None) is not None:  # fp8 with fp8_gather
                    gathered_8bit += n
        return WeightUnit(name, gathered, gathered_8bit, reduced)

    def weights(layer):  # what `tfllm.parallel.context.block_weights` hands a block
        return [v for v in layer.weights
                if v.trainable or getattr(v, "kind", "fp8_state") != "fp8_state"]

    table = model.token_embedding.trainable_variables
    head = model.final_norm.trainable_variables + (
        table if model.lm_head is None else model.lm_head.trainable_variables)
    return ((unit("token_embedding", table),)
            + tuple(unit(b.name, weights(b)) for b in model.blocks)
            + (unit("final_norm + head", head),))


def _trainable_gradient_bytes(rows) -> int:
    """Float32 gradient bytes of the trainable variables of layout rows (a variable's
    gradient is laid out as the variable: float32, its shard on a sharded mesh)."""
    out = 0
    for r in rows:
        if r.optimizer_bytes_per_device:  # trainable: AdamW keeps moments for it
            out += r.bytes_per_device * 4 // _DTYPE_BYTES.get(r.dtype, 4)
    return out


@dataclasses.dataclass(frozen=True)
class Gradients:
    """Float32 gradient bytes of the compiled no-mesh program against a mesh device's
    (`gradients`).

    Attributes:
      program: the compiled program's trainable variables' float32 gradients.
      device: a mesh device's, in their layouts.
      excess: program - device (0 at least).
      subtracted: the excess taken off the compiled total (0 with one micro-batch).
    """
    program: int
    device: int
    excess: int
    subtracted: int

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def gradients(plan: MeshPlan, program: MeshPlan) -> Gradients:
    """The float32 gradients of the no-mesh program against a mesh device's.

    The plan compiles the one-device step at one device's shapes (`MeshPlan.local`,
    whose own plan is `program`): its weights are whole over fsdp, so its gradients are
    too, and the step keeps them (`tfllm.train.step`: a running sum over the
    micro-batches, then the global-norm clip and the update). A mesh device keeps each
    gradient in its variable's layout: the shard its block's reduce-scatter yields
    (1/fsdp of it; a data axis keeps it whole). The difference is the compile's excess.

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
    """
    device = plan.gradient_bytes
    excess = max(program.gradient_bytes - device, 0)
    return Gradients(program=program.gradient_bytes, device=device, excess=excess,
                     subtracted=excess if plan.grad_accum_steps > 1 else 0)
