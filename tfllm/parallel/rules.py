"""Logical-axis sharding rules: pure functions, no devices, no TensorFlow.

Model code names the *logical* axes of each weight and large activation
(`("embed", "mlp")`). One ordered table of `(logical_axis, mesh_axis)` pairs says where
each goes. For each dimension of a tensor, in order, the candidates are the rules for
its logical name, tried in table order:

* a rule whose mesh axis is None makes the dimension replicated (explicitly);
* a rule whose mesh axis is absent from the mesh, has size 1, or is already used by an
  earlier dimension of the same tensor is skipped;
* otherwise the dimension is sharded over that mesh axis and must divide by its size.

A dimension whose candidates are all skipped stays replicated. A logical name with no
rule at all is an error (fail closed: nothing is replicated because a rule was
forgotten). DTensor shards a tensor dimension over at most one mesh axis, so each
dimension takes one rule.

Batch over data and fsdp together (hybrid sharding): DTensor cannot split the batch
dimension over two mesh axes, so when both are larger than 1 the default table splits
the batch's rows over `data` and its sequence over `fsdp` (`activation_length`'s rule).
Every device then computes a distinct slice of the batch's tokens. Per-token work
(projections, MLP, norms, loss) needs nothing more; attention gathers the keys and
values of its rows over `fsdp` (context parallelism inside the fsdp group, the fast
axis that already carries the weight all-gathers), and the gradient flows back
reduce-scattered. With only one of the two axes the batch's rows take it and the
sequence stays whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from tfllm.runtime.devices import MeshError

Rules = Sequence[Tuple[str, Optional[str]]]
Spec = Tuple[Optional[str], ...]

# Weights: "embed" is the FSDP dimension, "heads"/"mlp"/"vocab" the tensor-parallel ones.
# Activations use their own names (MaxText's convention) so that the residual stream is
# not sharded over fsdp just because the weights' embed dimension is.
DEFAULT_RULES: Tuple[Tuple[str, Optional[str]], ...] = (
    ("activation_batch", "data"),
    ("activation_batch", "fsdp"),
    # Taken only when the batch's rows did not take fsdp, i.e. data > 1 and fsdp > 1.
    ("activation_length", "fsdp"),
    ("activation_embed", None),
    ("activation_heads", "model"),
    ("activation_kv_heads", "model"),
    ("activation_head_dim", None),
    ("activation_mlp", "model"),
    ("activation_vocab", "model"),
    # Mixtures of experts: the experts dimension of the dispatched capacity buffers. On
    # the token side (B, E, C, .) the batch's rows come first and take the batch axis,
    # so the experts stay whole; on the expert side (E, B, C, .) the experts come first
    # and take it: the relayout between the two is expert parallelism's all-to-all.
    ("activation_experts", "data"),
    ("activation_experts", "fsdp"),
    ("vocab", "model"),
    ("embed", "fsdp"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    # Expert parallelism: the stacked expert kernels (E, D, F) split their experts over
    # the mesh axis that carries the batch's rows (data, else fsdp), as torchtitan
    # derives EP from its data-parallel shard dimensions, and not over an `expert` axis of
    # their own as MaxText does: DTensor splits the batch dimension over one mesh axis
    # only, so tokens spread over an `expert` axis beside data or fsdp would have to split
    # the sequence (which a per-sequence dispatch cannot plan), or be replicated over it
    # (every expert device redoing the dense parts). On the batch's own axis the
    # relayout of the dispatched buffers from rows to experts is one all-to-all that
    # moves each token to its experts' device and back. The rest of an expert kernel
    # takes what is left (mlp over model; embed over fsdp only when the experts did not
    # take fsdp); expert-sharded dimensions are never gathered (`compute_spec`).
    ("experts", "data"),
    ("experts", "fsdp"),
    ("head_dim", None),
    ("position", None),
    ("norm", None),
)

# The mesh axes the default table knows. A mesh may use others only with custom rules.
KNOWN_MESH_AXES = ("data", "fsdp", "model")


class ShardingError(ValueError):
    """A tensor cannot be laid out; the message names the tensor and the fix."""


def rules_from_config(pairs) -> Tuple[Tuple[str, Optional[str]], ...]:
    """The rules table a config asks for: its `mesh.rules`, or the defaults when empty."""
    if not pairs:
        return DEFAULT_RULES
    return tuple((str(l), None if m is None else str(m)) for l, m in pairs)


def mesh_axes_of(rules: Rules) -> Tuple[str, ...]:
    """Mesh axis names that a rules table refers to, in first-use order."""
    seen = []
    for _, m in rules:
        if m is not None and m not in seen:
            seen.append(m)
    return tuple(seen)


def candidate_axis(logical: str, rules: Rules, mesh_shape: Mapping[str, int],
                   used=()) -> Optional[str]:
    """The mesh axis `resolve_spec` would try for `logical` (first rule with an axis of size
    > 1 not in `used`; None when a None rule comes first), before checking divisibility:
    lets callers say what must divide before the generic sharding error would."""
    for l, m in rules:
        if l != logical:
            continue
        if m is None:
            return None
        if mesh_shape.get(m, 1) > 1 and m not in used:
            return m
    return None


def token_batch_spec(shape: Sequence[int], rules: Rules,
                     mesh_shape: Mapping[str, int]) -> Spec:
    """The layout of a batch of token rows (M, T+1, ...): rows over the batch's mesh axis,
    the rest whole. The one owner of "which axis carries the batch".

    The length stays unsharded here because T+1 rarely divides; the model's inputs and
    targets (T tokens) are laid out by the activation rules once sliced, which is local.
    """
    axes = ("activation_batch",) + (None,) * (len(shape) - 1)
    return resolve_spec("batch", shape, axes, rules, mesh_shape)


def sequence_axis(batch_rows: int, length: int, rules: Rules,
                  mesh_shape: Mapping[str, int]) -> Optional[str]:
    """The mesh axis that splits the sequence of the model's (M, T) activations, or None."""
    spec = resolve_spec("activations", (batch_rows, length),
                        ("activation_batch", "activation_length"), rules, mesh_shape)
    return spec[1]


@dataclass(frozen=True)
class BatchLayout:
    """How a training batch lies on the mesh (`batch_layout`).

    Attributes:
      micro_batch_rows: M, the rows of one micro-batch (global batch / accumulation).
      rows_axis: the mesh axis of a micro-batch's rows (None: every device has them all).
      sequence_axis: the mesh axis that splits the model's (M, T) sequence (None: whole).
    """
    micro_batch_rows: int
    rows_axis: Optional[str]
    sequence_axis: Optional[str]


def batch_layout(global_batch: int, grad_accum: int, sequence_length: int, rules: Rules,
                 mesh_shape: Mapping[str, int]) -> BatchLayout:
    """The one question for a batch's layout: which mesh axes carry its rows and its
    sequence, checked to divide (`check_batch`'s error, naming train.global_batch_size or
    data.sequence_length, comes before the generic sharding error could).

    Args:
      global_batch, grad_accum: train.global_batch_size, train.grad_accum_steps.
      sequence_length: data.sequence_length (T; a batch's rows hold T+1 tokens).
      rules: the rules table.
      mesh_shape: mesh axis name -> size.

    Raises:
      MeshError: the rows or the sequence do not divide over their mesh axes.
    """
    rows_axis = candidate_axis("activation_batch", rules, mesh_shape)
    check_batch(global_batch, grad_accum, rows_axis, mesh_shape, sequence_length,
                candidate_axis("activation_length", rules, mesh_shape, used=(rows_axis,)))
    micro = global_batch // grad_accum
    return BatchLayout(micro, token_batch_spec((micro, sequence_length + 1), rules,
                                               mesh_shape)[0],
                       sequence_axis(micro, sequence_length, rules, mesh_shape))


def check_batch(global_batch: int, grad_accum: int, spec_axis: Optional[str], shape: dict,
                sequence_length: Optional[int] = None,
                sequence_axis: Optional[str] = None) -> None:
    """Each micro-batch must split evenly over the mesh axis that shards its rows, and the
    sequence over the axis that splits it (batch over data and fsdp together)."""
    micro = global_batch // grad_accum
    if spec_axis and micro % shape[spec_axis]:
        raise MeshError(
            f"train.global_batch_size ({global_batch}) / train.grad_accum_steps ({grad_accum}) "
            f"= {micro} sequences per micro-batch do not divide over mesh axis '{spec_axis}' "
            f"(size {shape[spec_axis]}); use a multiple of {shape[spec_axis]}.")
    if sequence_axis and sequence_length and sequence_length % shape[sequence_axis]:
        raise MeshError(
            f"data.sequence_length ({sequence_length}) does not divide over mesh axis "
            f"'{sequence_axis}' (size {shape[sequence_axis]}), which splits the sequence "
            f"because the batch's rows take '{spec_axis}'; use a multiple of "
            f"{shape[sequence_axis]}, or a mesh without both axes.")


def compute_spec(spec: Spec, logical_axes: Sequence[Optional[str]], batch_axes) -> Spec:
    """The layout a weight computes in: dimensions sharded over a batch axis are gathered
    (FSDP), except the experts of an expert-parallel kernel, which each device computes
    on its own tokens' and everyone else's (after the all-to-all)."""
    return tuple(None if m in batch_axes and name != "experts" else m
                 for m, name in zip(spec, logical_axes))


def expert_axis(num_experts: int, rules: Rules, mesh_shape: Mapping[str, int]) -> Optional[str]:
    """The mesh axis the experts split over (expert parallelism), or None; refuses in one
    line a table or mesh it cannot work with.

    Raises:
      MeshError: the experts do not divide over their axis, or their axis is not the one
        that carries the batch's rows (the all-to-all exchanges tokens over that axis).
    """
    axis = candidate_axis("experts", rules, mesh_shape)
    if axis is None:
        return None
    rows = candidate_axis("activation_batch", rules, mesh_shape)
    if axis != rows or candidate_axis("activation_experts", rules, mesh_shape) != axis:
        raise MeshError(
            f"mesh.rules: the experts split over '{axis}' but the batch's rows over "
            f"'{rows}' and the dispatched buffers' experts over "
            f"'{candidate_axis('activation_experts', rules, mesh_shape)}'; expert "
            "parallelism exchanges tokens over the rows' axis: map 'experts' and "
            "'activation_experts' to it, or 'experts' to null (replicated experts).")
    if num_experts % mesh_shape[axis]:
        raise MeshError(
            f"model.num_experts ({num_experts}) does not divide over mesh axis '{axis}' "
            f"(size {mesh_shape[axis]}), which splits the experts (expert parallelism); "
            f"use a multiple of {mesh_shape[axis]} experts, a mesh whose '{axis}' size "
            "divides them, or mesh.rules starting with ['experts', null] and "
            "['activation_experts', null] to replicate them.")
    return axis


def activation_mesh_axes(rules: Rules):
    """Mesh axes that the rules may split activations' tokens over (rows or sequence):
    weights sharded over them are all-gathered before use (FSDP)."""
    return {m for l, m in rules
            if l in ("activation_batch", "activation_length") and m is not None}


def without_sequence_sharding(rules: Rules) -> Tuple[Tuple[str, Optional[str]], ...]:
    """`rules` with the sequence never split (decoding writes one token at a time)."""
    return (("activation_length", None),) + tuple(rules)


def resolve_spec(path: str, shape: Sequence[int], logical_axes: Sequence[Optional[str]],
                 rules: Rules, mesh_shape: Mapping[str, int]) -> Spec:
    """Maps a tensor's logical axes to mesh axes (None = replicated) per dimension.

    Args:
      path: the tensor's name, used in error messages (e.g. "gpt/block_0/mlp/up/kernel").
      shape: its global shape.
      logical_axes: one logical name (or None for "never shard") per dimension.
      rules: ordered (logical_axis, mesh_axis or None) pairs.
      mesh_shape: mesh axis name -> size.

    Returns:
      A tuple with one mesh axis name or None per dimension.

    Raises:
      ShardingError: a logical name has no rule, or a dimension does not divide.
    """
    if len(shape) != len(logical_axes):
        raise ShardingError(f"{path}: shape {tuple(shape)} has {len(shape)} dimensions but "
                            f"{len(logical_axes)} logical axes {tuple(logical_axes)} were "
                            "declared; declare one logical axis per dimension.")
    used = set()
    spec = []
    for dim, (size, name) in enumerate(zip(shape, logical_axes)):
        if name is None:
            spec.append(None)
            continue
        candidates = [m for l, m in rules if l == name]
        if not candidates:
            raise ShardingError(
                f"{path}: logical axis '{name}' (dimension {dim}) has no sharding rule. Add "
                f"a pair ['{name}', <mesh axis or null>] to mesh.rules.")
        chosen = None
        for m in candidates:
            if m is None:
                break
            if mesh_shape.get(m, 1) <= 1 or m in used:
                continue
            chosen = m
            break
        if chosen is not None:
            if size % mesh_shape[chosen]:
                raise ShardingError(
                    f"{path}: dimension {dim} ('{name}', size {size}) is not divisible by mesh "
                    f"axis '{chosen}' (size {mesh_shape[chosen]}). Choose a mesh whose "
                    f"'{chosen}' size divides {size}, change the model size, or map '{name}' "
                    "elsewhere in mesh.rules.")
            used.add(chosen)
        spec.append(chosen)
    return tuple(spec)


def zero1_spec(path: str, shape: Sequence[int], spec: Spec,
               mesh_shape: Mapping[str, int], axis: str = "data") -> Spec:
    """ZeRO-1: a parameter's spec further sharded over `axis` for its optimizer states.

    The first replicated dimension that `axis` divides takes it. When the parameter
    already uses `axis`, or no dimension divides, the parameter's own spec is returned.
    """
    size = mesh_shape.get(axis, 1)
    if size <= 1 or axis in spec:
        return tuple(spec)
    for dim, (n, m) in enumerate(zip(shape, spec)):
        if m is None and n % size == 0:
            return tuple(spec[:dim]) + (axis,) + tuple(spec[dim + 1:])
    return tuple(spec)


def shard_shape(shape: Sequence[int], spec: Spec, mesh_shape: Mapping[str, int]) -> Tuple[int, ...]:
    """The per-device shape of a tensor laid out by `spec`."""
    return tuple(n // (mesh_shape[m] if m else 1) for n, m in zip(shape, spec))


def spec_to_str(spec: Spec) -> str:
    return "[" + ", ".join(m or "-" for m in spec) + "]"

