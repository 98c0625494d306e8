"""Token dispatch for mixture-of-experts blocks: where each token's k choices are computed.

Both plans work in groups of one sequence each (GShard's groups: a row never sends tokens
to another row's buffers, so under data parallelism a plan stays on each device). Both
start the same way (`sort_by_expert`): the row's T*k assignments, first choices of all
tokens, then second choices, ... (so a token's first choice claims capacity before
anyone's second, as GShard and Switch do), stably sorted by expert; an assignment's
position within its expert is its rank in the sort minus the expert's start. Outputs come
back by a gather (`gather_back`), not a scatter-add: deterministic on every device. Every
shape is static, so both compile under XLA.

* `plan_slots`: each expert gets C slots per row, (B, T, D) -> (B, E, C, D), and the
  experts run as batched einsums over E. Dropless: C = T, the exact bound (a token's k
  experts are distinct, so an expert receives at most T assignments of a row), at E/k
  times the active FLOPs (E*T slots where k*T hold tokens). Capacity factor f:
  C = min(T, max(1, ceil(f * T * k / E))); an assignment at position C or beyond in its
  expert is dropped and contributes zero (the token keeps its other experts' outputs
  with their weights unchanged, not renormalized; a token with every choice dropped gets
  zero and passes through the block's residual). Padding tokens are routed like others
  and may take capacity. Expert parallelism relayouts the slots from rows to experts
  (the all-to-all).
* `plan_grouped`: dropless, MegaBlocks' layout: the sorted assignments with each expert's
  group padded to whole tiles of `tile` rows, so every tile belongs to one expert, for
  `grouped.grouped_matmul`. A static tile count holds any routing:
  sum_e ceil(n_e / tile) <= (T*k + E*(tile - 1)) / tile, so the FLOPs are the tokens'
  own plus at most E*(tile - 1) padding rows per sequence. One device (or FSDP) only: a
  tile reads its expert's kernel wherever it lives.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import tensorflow as tf


def sort_by_expert(experts, num_experts: int):
    """Each row's assignments, choice-major, stably sorted by expert.

    Args:
      experts: (B, T, k) int32, the chosen experts of each token.
      num_experts: E.

    Returns:
      (flat (B, T*k) the expert of each choice-major assignment, order (B, T*k) the
      assignments sorted by expert, counts (B, E), starts (B, E) each expert's first
      index in `order`, position (B, T*k) each assignment's index within its expert).
    """
    length, top_k = experts.shape[1], experts.shape[2]
    # (B, k*T): choice-major, so that every first choice precedes every second choice.
    flat = tf.reshape(tf.transpose(experts, [0, 2, 1]), [-1, length * top_k])
    order = tf.argsort(flat, axis=-1, stable=True)
    # Per row, as a sum of one-hots (B, T*k, E) -> (B, E): a segment sum over the
    # flattened rows made DTensor all-gather every row's routing on a batch-split mesh.
    counts = tf.reduce_sum(tf.one_hot(flat, num_experts, dtype=tf.int32), axis=1)
    starts = tf.cumsum(counts, axis=-1, exclusive=True)  # (B, E)
    rank = tf.argsort(order, axis=-1, stable=True)  # the inverse permutation
    position = rank - tf.gather(starts, flat, batch_dims=1)
    return flat, order, counts, starts, position


class Plan(NamedTuple):
    """Which token each computed row reads, and which row each assignment reads back.

    Attributes:
      row_token: (B, R) int32, the token (position in its row) each computed row reads;
        T for an empty row (a zero row appended to the tokens).
      assignment_row: (B, k, T) int32, the computed row holding assignment (t, j)'s
        output; R when dropped (a zero row appended to the outputs).
      capacity: `plan_slots`: C, slots per expert (R = E*C); `plan_grouped`: 0.
      tile_expert: `plan_grouped`: (B, R / tile) int32, the expert of each tile; else None.
      tile: `plan_grouped`: rows per tile; else 0.
    """
    row_token: tf.Tensor
    assignment_row: tf.Tensor
    capacity: int = 0
    tile_expert: Optional[tf.Tensor] = None
    tile: int = 0


def expert_capacity(length: int, top_k: int, num_experts: int,
                    capacity_factor: Optional[float]) -> int:
    """Slots per expert and row: T when dropless (the exact bound), else
    min(T, max(1, ceil(capacity_factor * T * k / E)))."""
    if capacity_factor is None:
        return length
    return min(length, max(1, math.ceil(capacity_factor * length * top_k / num_experts)))


def _rows_of(order, starts, counts, row_expert, within, length: int):
    """The token each computed row reads: row r holds the within[r]-th assignment of
    expert row_expert[r] when that expert has one, else reads the zero row (T)."""
    filled = within < tf.gather(counts, row_expert, batch_dims=1)
    source = tf.minimum(tf.gather(starts, row_expert, batch_dims=1) + within,
                        order.shape[1] - 1)
    return tf.where(filled, tf.gather(order, source, batch_dims=1) % length, length)


def plan_slots(experts, num_experts: int, capacity: int) -> Plan:
    """C slots per expert and row, row e*C + c the c-th assignment of expert e (module
    docstring; assignments past C are dropped).

    Args:
      experts: (B, T, k) int32, the chosen experts of each token (distinct per token).
      num_experts: E.
      capacity: C (`expert_capacity`).
    """
    length, top_k = experts.shape[1], experts.shape[2]
    flat, order, counts, starts, position = sort_by_expert(experts, num_experts)
    slots = num_experts * capacity
    rows = tf.zeros_like(counts[:, :1]) + tf.range(slots)  # (B, E*C)
    row_token = _rows_of(order, starts, counts, rows // capacity, rows % capacity, length)
    row = tf.where(position < capacity, flat * capacity + position, slots)
    return Plan(row_token, tf.reshape(row, [-1, top_k, length]), capacity=capacity)


def num_tiles(length: int, top_k: int, num_experts: int, tile: int) -> int:
    """Tiles per row that hold any routing: ceil((T*k + E*(tile - 1)) / tile)."""
    return -(-(length * top_k + num_experts * (tile - 1)) // tile)


def plan_grouped(experts, num_experts: int, tile: int) -> Plan:
    """Each expert's assignments padded to whole tiles of `tile` rows (module docstring).

    Args:
      experts: (B, T, k) int32, the chosen experts of each token (distinct per token).
      num_experts: E.
      tile: rows per tile.
    """
    length, top_k = experts.shape[1], experts.shape[2]
    flat, order, counts, starts, position = sort_by_expert(experts, num_experts)
    padded = -(-counts // tile) * tile  # (B, E) each group rounded up to whole tiles
    padded_starts = tf.cumsum(padded, axis=-1, exclusive=True)
    tiles = num_tiles(length, top_k, num_experts, tile)
    # A tile's expert: the number of groups that end at or before its first row (tiles
    # past the last group are padding; they take the last expert and read zero rows).
    first_rows = tf.range(tiles) * tile
    ended = (padded_starts + padded)[:, None, :] <= first_rows[None, :, None]  # (B, J, E)
    tile_expert = tf.minimum(tf.reduce_sum(tf.cast(ended, tf.int32), axis=-1),
                             num_experts - 1)  # (B, J)
    row_expert = tf.repeat(tile_expert, tile, axis=1)  # (B, R)
    within = tf.range(tiles * tile) - tf.gather(padded_starts, row_expert, batch_dims=1)
    row_token = _rows_of(order, starts, counts, row_expert, within, length)
    row = tf.gather(padded_starts, flat, batch_dims=1) + position
    return Plan(row_token, tf.reshape(row, [-1, top_k, length]), tile_expert=tile_expert,
                tile=tile)


def _with_zero_row(x):
    """(B, N, ...) -> (B, N + 1, ...): a zero row that empty and dropped rows read."""
    return tf.concat([x, tf.zeros_like(x[:, :1])], axis=1)


# The two gathers' gradients are gathers too (written out below): TensorFlow's gradient of
# a batch_dims gather is a scatter into the flattened (B * N) rows with offsets from the
# tensor's shape, which on a batch-sharded DTensor is the global shape while the scatter
# runs on each device's rows ("indices[511] = [1020] does not index into shape [128]"). A
# gather by the plan's inverse map needs no offsets, and sums in a fixed order.
def gather_rows(x, plan: Plan):
    """(B, T, D) -> (B, R, D): each computed row's token (zeros when empty)."""
    @tf.custom_gradient
    def take(x):
        def grad(dy):  # (B, R, D) -> (B, T, D): a token's rows are its k assignments'
            picked = tf.gather(_with_zero_row(dy), plan.assignment_row, batch_dims=1)
            return tf.reduce_sum(picked, axis=1)  # (B, k, T, D) -> (B, T, D)
        return tf.gather(_with_zero_row(x), plan.row_token, batch_dims=1), grad
    return take(x)


def gather_back(out, plan: Plan, weights):
    """(B, R, D) computed rows -> (B, T, D): each token's k outputs (zeros when dropped)
    weighted by `weights` (B, T, k) and summed."""
    @tf.custom_gradient
    def take(out):
        def grad(dy):  # (B, k, T, D) -> (B, R, D): row r holds assignment (t_r, j_r)
            # For each row, its token's k gradients (B, k, R, D); the one whose assignment
            # is this row is kept (an empty row's token is the zero row T: nothing).
            at_token = tf.gather(_with_zero_row(tf.transpose(dy, [0, 2, 1, 3])),
                                 plan.row_token, batch_dims=1)  # (B, R, k, D)
            rows = tf.shape(plan.row_token)[1]
            owner = tf.gather(_with_zero_row(tf.transpose(plan.assignment_row, [0, 2, 1])),
                              plan.row_token, batch_dims=1)  # (B, R, k)
            mine = tf.equal(owner, tf.range(rows)[None, :, None])
            return tf.reduce_sum(at_token * tf.cast(mine, dy.dtype)[..., None], axis=2)
        return tf.gather(_with_zero_row(out), plan.assignment_row, batch_dims=1), grad
    picked = take(out)  # (B, k, T, D)
    w = tf.cast(tf.transpose(weights, [0, 2, 1]), out.dtype)  # (B, k, T)
    return tf.einsum("bktd,bkt->btd", picked, w)
