"""Mixture-of-experts feed-forward block: a router, k of E SwiGLU experts per token.

A router (hidden -> E logits, no bias) picks `top_k` experts for each token; each expert
is a gated MLP; the token's output is the weighted sum of its experts' outputs (plus, for
Qwen2-MoE, a shared expert gated by a sigmoid). Both routings of transformers:

* `topk_then_softmax` (Mixtral): the softmax over the k largest logits;
* `softmax_then_topk` (Qwen2/3-MoE): the softmax over all E logits, then the k largest
  probabilities, renormalized to sum to one when `normalize_top_k` (`norm_topk_prob`).
  With renormalization the two are equal in exact arithmetic (transformers 5 computes
  Mixtral's this way); they differ by rounding only.

Weights: one stacked kernel per projection, `gate`/`up` (E, hidden, intermediate) and
`down` (E, intermediate, hidden), whose first logical axis is `experts`, so the rules
table lays the experts out over a mesh axis without the model knowing which.

Dispatch (`plan_dispatch`), in groups of one sequence each (GShard's groups: a row never
sends tokens to another row's buffer, so under data parallelism the plan stays on each
device, and expert parallelism is one relayout of the (B, E, C, D) buffer from rows to
experts, the all-to-all):

1. the row's T*k assignments, first choices of all tokens, then second choices, ... (so a
   token's first choice claims capacity before anyone's second, as GShard and Switch do),
   are sorted by expert with a stable sort; an assignment's position within its expert
   is its rank in the sorted order minus the expert's start;
2. each expert's C slots gather their tokens (an empty slot reads a zero row):
   (B, T, D) -> (B, E, C, D), and the experts run as three batched einsums over E;
3. each assignment gathers its slot's output back, weighted by its routing weight and
   summed over k (a gather, not a scatter-add: deterministic on every device).

Every shape is static (C is a Python int), so the block compiles under XLA. Dropless
(`capacity_factor=None`): C = T, the exact bound, since the k experts of a token are
distinct an expert receives at most T assignments of a row; nothing is ever dropped.
The price: the einsums run over E*T slots per row where k*T hold tokens, E/k times the
active FLOPs (TensorFlow has no ragged grouped matmul; see docs and
benchmarks/moe_dispatch.py). Capacity mode (`capacity_factor=f`): C = min(T,
max(1, ceil(f * T * k / E))); an assignment whose position within its expert is C or
more is dropped, contributing zero (the token keeps its other experts' outputs with
their weights unchanged, not renormalized; a token with every assignment dropped gets
zero and passes through the block's residual). Padding tokens are routed like others
and may take capacity; the token mask only excludes them from the statistics.

The block returns `(y, RouterStats)`: the statistics `load_balancing_loss` combines over
layers exactly as transformers' `load_balancing_loss_func` does, the router z-loss and
per-expert assignment counts for metrics.
"""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple, Optional, Sequence

import keras
import tensorflow as tf

from tfllm.models.common import noise
from tfllm.models.common.layers import Projection
from tfllm.models.common.mlp import GATED_ACTIVATIONS, GatedMLP
from tfllm.models.common.remat import recompute
from tfllm.parallel.context import constrain

ROUTINGS = ("topk_then_softmax", "softmax_then_topk")

_EMBED = ("activation_batch", "activation_length", "activation_embed")
_LOGITS = ("activation_batch", "activation_length", None)
# The dispatched buffers (B, E, C, .): rows, experts, slots, features.
_SLOTS_EMBED = ("activation_batch", "activation_experts", None, "activation_embed")
_SLOTS_MLP = ("activation_batch", "activation_experts", None, "activation_mlp")


class RouterStats(NamedTuple):
    """What one MoE block's routing did, summed over its (unmasked) tokens; float32.

    Attributes:
      expert_counts: (E,) assignments per expert (top-k choices, before any drop): the
        per-expert token counts for metrics, and the `f` of the load-balancing loss.
      prob_sum: (E,) the router's softmax probabilities summed over tokens (the `P`).
      num_tokens: () tokens counted (the mask's sum).
      z_sum: () sum over tokens of logsumexp(logits)^2 (ST-MoE's router z-loss).
      dropped: () assignments dropped for capacity (0 when dropless).
    """
    expert_counts: tf.Tensor
    prob_sum: tf.Tensor
    num_tokens: tf.Tensor
    z_sum: tf.Tensor
    dropped: tf.Tensor


def load_balancing_loss(stats: Sequence[RouterStats]) -> tf.Tensor:
    """Switch's auxiliary loss E * sum_e f_e P_e over all layers, as transformers'
    `load_balancing_loss_func`: counts and probabilities are summed over the layers and
    divided by the tokens of all layers before the product (not a mean of per-layer
    losses). The step adds `router_aux_loss_coef` times it to the loss.

    Args:
      stats: the `RouterStats` of every MoE block of the forward pass.
    """
    counts = tf.add_n([s.expert_counts for s in stats])
    probs = tf.add_n([s.prob_sum for s in stats])
    rows = tf.add_n([s.num_tokens for s in stats])
    num_experts = tf.cast(tf.shape(counts)[0], tf.float32)
    # f = counts / rows sums to k per token (transformers counts every top-k choice).
    return num_experts * tf.reduce_sum((counts / rows) * (probs / rows))


def router_z_loss(stats: Sequence[RouterStats]) -> tf.Tensor:
    """ST-MoE's router z-loss, mean over tokens of logsumexp(logits)^2, averaged over the
    layers; the step adds its coefficient (ST-MoE: 1e-3) times it to the loss."""
    return tf.add_n([s.z_sum / s.num_tokens for s in stats]) / len(stats)


def route(logits, top_k: int, routing: str, normalize_top_k: bool = True):
    """Routing weights and experts of each token.

    Args:
      logits: (..., E) float32 router logits.
      top_k: experts per token.
      routing: one of `ROUTINGS` (see the module docstring).
      normalize_top_k: `softmax_then_topk` only: renormalize the k probabilities.

    Returns:
      (weights (..., k) float32, experts (..., k) int32), largest weight first.
    """
    if routing == "topk_then_softmax":
        values, experts = tf.math.top_k(logits, top_k)
        return tf.nn.softmax(values, axis=-1), experts
    values, experts = tf.math.top_k(tf.nn.softmax(logits, axis=-1), top_k)
    if normalize_top_k:
        values = values / tf.reduce_sum(values, axis=-1, keepdims=True)
    return values, experts


class DispatchPlan(NamedTuple):
    """Where each token goes and where its outputs come back from (one row = one group).

    Attributes:
      slot_token: (B, E*C) int32, the token (position in its row) each expert slot reads;
        T for an empty slot (a zero row appended to the tokens).
      assignment_slot: (B, k, T) int32, the flat slot e*C + c whose output assignment
        (token t's j-th choice) reads; E*C when dropped (a zero row appended).
      capacity: C, slots per expert and row.
    """
    slot_token: tf.Tensor
    assignment_slot: tf.Tensor
    capacity: int


def expert_capacity(length: int, top_k: int, num_experts: int,
                    capacity_factor: Optional[float]) -> int:
    """Slots per expert and row: T when dropless (the exact bound), else
    min(T, max(1, ceil(capacity_factor * T * k / E)))."""
    if capacity_factor is None:
        return length
    return min(length, max(1, math.ceil(capacity_factor * length * top_k / num_experts)))


def plan_dispatch(experts, num_experts: int, capacity: int) -> DispatchPlan:
    """Sorts each row's assignments by expert and gives each its slot (module docstring).

    Args:
      experts: (B, T, k) int32, the chosen experts of each token (distinct per token).
      num_experts: E.
      capacity: C, slots per expert and row (`expert_capacity`).
    """
    length, top_k = experts.shape[1], experts.shape[2]
    rows = experts.shape[0] if experts.shape[0] is not None else tf.shape(experts)[0]
    n = length * top_k
    # (B, k*T): choice-major, so that every first choice precedes every second choice.
    flat = tf.reshape(tf.transpose(experts, [0, 2, 1]), [-1, n])
    order = tf.argsort(flat, axis=-1, stable=True)  # (B, A) assignments grouped by expert
    row_offset = num_experts * tf.range(rows)[:, None]
    counts = tf.reshape(tf.math.unsorted_segment_sum(tf.ones_like(flat), flat + row_offset,
                                                     rows * num_experts),
                        [-1, num_experts])  # (B, E)
    starts = tf.cumsum(counts, axis=-1, exclusive=True)  # (B, E)
    # Slot (e, c) holds the c-th assignment of expert e in sorted order, when it has one.
    slots = tf.range(capacity)
    source = tf.minimum(starts[:, :, None] + slots, n - 1)  # (B, E, C)
    assignment = tf.gather(order, tf.reshape(source, [-1, num_experts * capacity]),
                           batch_dims=1)  # (B, E*C)
    filled = tf.reshape(slots < counts[:, :, None], [-1, num_experts * capacity])
    slot_token = tf.where(filled, assignment % length, length)
    # An assignment's position within its expert: its rank in the sort minus the start.
    rank = tf.argsort(order, axis=-1, stable=True)  # (B, A) the inverse permutation
    position = rank - tf.gather(starts, flat, batch_dims=1)
    slot = tf.where(position < capacity, flat * capacity + position,
                    num_experts * capacity)
    return DispatchPlan(slot_token, tf.reshape(slot, [-1, top_k, length]), capacity)


def _with_zero_row(x):
    """(B, N, ...) -> (B, N + 1, ...): a zero row that empty and dropped slots read."""
    return tf.concat([x, tf.zeros_like(x[:, :1])], axis=1)


def dispatch_tokens(x, plan: DispatchPlan, num_experts: int):
    """(B, T, D) -> (B, E, C, D): each expert slot's token (zeros when empty)."""
    buffer = tf.gather(_with_zero_row(x), plan.slot_token, batch_dims=1)  # (B, E*C, D)
    return tf.reshape(buffer, [-1, num_experts, plan.capacity, x.shape[-1]])


def combine_outputs(out, plan: DispatchPlan, weights):
    """(B, E, C, D) expert outputs -> (B, T, D): each token's k slot outputs (zeros when
    dropped) weighted by `weights` (B, T, k) and summed."""
    num_slots = out.shape[1] * out.shape[2]
    flat = _with_zero_row(tf.reshape(out, [-1, num_slots, out.shape[-1]]))  # (B, E*C+1, D)
    picked = tf.gather(flat, plan.assignment_slot, batch_dims=1)  # (B, k, T, D)
    w = tf.cast(tf.transpose(weights, [0, 2, 1]), out.dtype)  # (B, k, T)
    return tf.einsum("bktd,bkt->btd", picked, w)


class MoeMLP(keras.layers.Layer):
    """Sparse mixture-of-experts MLP: `call(x)` -> `(y, RouterStats)`, y (B, T, D) like x.

    A decoder block swaps its MLP for this one by unpacking the pair and handing the
    statistics to the model (`load_balancing_loss`, `router_z_loss`, metrics).

    Args:
      hidden_dim: D.
      intermediate_dim: F, each expert's width (`moe_intermediate_size`).
      num_experts: E.
      top_k: experts per token (`num_experts_per_tok`).
      routing: "topk_then_softmax" (Mixtral) or "softmax_then_topk" (Qwen2/3-MoE).
      normalize_top_k: renormalize the k probabilities (`norm_topk_prob`; with
        softmax_then_topk only).
      capacity_factor: None for dropless dispatch, else the capacity factor (module
        docstring: what is dropped).
      router_jitter: in training, multiply the tokens by U(1 - j, 1 + j) before routing
        and the experts (transformers' Mixtral `router_jitter_noise`; 0 = off).
      shared_intermediate_dim: width of Qwen2-MoE's shared expert, gated by
        sigmoid(x w), added to every token's output; None = no shared expert.
      activation: the experts' gated activation (see `GATED_ACTIVATIONS`).
      init_std: init of the router, gate and up.
      output_init_std: init of down (scaled for depth).
      fp8: FP8 expert GEMMs are not implemented; must be None.
    """

    def __init__(self, hidden_dim: int, intermediate_dim: int, num_experts: int,
                 top_k: int, routing: str = "softmax_then_topk",
                 normalize_top_k: bool = True, capacity_factor: Optional[float] = None,
                 router_jitter: float = 0.0, shared_intermediate_dim: Optional[int] = None,
                 activation: str = "silu", init_std: float = 0.02,
                 output_init_std: float = 0.02, fp8=None, **kwargs):
        super().__init__(**kwargs)
        if routing not in ROUTINGS:
            raise ValueError(f"{self.name}: routing {routing!r}; use one of {ROUTINGS}.")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{self.name}: top_k={top_k} with {num_experts} experts; "
                             "choose 1 <= top_k <= num_experts.")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"{self.name}: capacity_factor={capacity_factor}; use a "
                             "positive factor, or None for dropless dispatch.")
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"{self.name}: activation {activation!r}; use one of "
                             f"{sorted(GATED_ACTIVATIONS)}.")
        if fp8 is not None:
            raise ValueError(f"{self.name}: FP8 expert projections are not implemented; "
                             "exclude the MoE blocks from fp8 (fp8.exclude).")
        self.hidden_dim, self.intermediate_dim = hidden_dim, intermediate_dim
        self.num_experts, self.top_k = num_experts, top_k
        self.routing, self.normalize_top_k = routing, normalize_top_k
        self.capacity_factor, self.router_jitter = capacity_factor, router_jitter
        self.activation = GATED_ACTIVATIONS[activation]
        self.recompute_activation = False  # set by the model's remat policy
        d, f, e = hidden_dim, intermediate_dim, num_experts
        policy = self.dtype_policy
        # The router is small and every token needs all of its E columns: never sharded.
        self.router = Projection("btd,de->bte", (d, e), ("embed", None), init_std=init_std,
                                 output_axes=_LOGITS, name="router", dtype=policy)
        kw = dict(init_std=init_std, output_axes=_SLOTS_MLP, dtype=policy)
        self.gate = Projection("becd,edf->becf", (e, d, f), ("experts", "embed", "mlp"),
                               name="gate", **kw)
        self.up = Projection("becd,edf->becf", (e, d, f), ("experts", "embed", "mlp"),
                             name="up", **kw)
        self.down = Projection("becf,efd->becd", (e, f, d), ("experts", "mlp", "embed"),
                               init_std=output_init_std, output_axes=_SLOTS_EMBED,
                               name="down", dtype=policy)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_dim is not None:
            self.shared_expert = GatedMLP(d, shared_intermediate_dim, init_std=init_std,
                                          output_init_std=output_init_std,
                                          activation=activation, name="shared_expert",
                                          dtype=policy)
            self.shared_expert_gate = Projection("btd,do->bto", (d, 1), ("embed", None),
                                                 init_std=init_std, name="shared_expert_gate",
                                                 dtype=policy)

    def build(self, input_shape=None):
        for layer in (self.router, self.gate, self.up, self.down, self.shared_expert,
                      self.shared_expert_gate):
            if layer is not None:
                layer.build(None)

    def call(self, x, token_mask=None):
        """x (B, T, D) -> (y (B, T, D), RouterStats).

        Args:
          x: the tokens; T must be static (the capacity is a shape).
          token_mask: (B, T), 1 for tokens the statistics count (transformers'
            attention_mask for the aux loss); None counts every token.
        """
        length = x.shape[1]
        if length is None:
            raise ValueError(f"{self.name}: the sequence length must be static (the "
                             "expert capacity is a shape); trace with a fixed length.")
        if self.router_jitter and noise.current() is not None:  # training only
            x = x * self._jitter(x)
        logits = tf.cast(self.router(x), tf.float32)  # (B, T, E)
        weights, experts = route(logits, self.top_k, self.routing, self.normalize_top_k)
        capacity = expert_capacity(length, self.top_k, self.num_experts,
                                   self.capacity_factor)
        plan = plan_dispatch(experts, self.num_experts, capacity)
        y = combine_outputs(self._experts(self._dispatch(x, plan)), plan, weights)
        if self.shared_expert is not None:
            gate = tf.sigmoid(self.shared_expert_gate(x))  # (B, T, 1)
            y = y + gate * self.shared_expert(x)
        return constrain(y, _EMBED, self.name), self._stats(logits, experts, plan, token_mask)

    def _jitter(self, x):
        """U(1 - j, 1 + j) per element, from the step's seed and this layer's path."""
        seed = tf.stack([tf.cast(noise.current(), tf.int64),
                         tf.constant(zlib.crc32(self.path.encode()) & 0x7FFFFFFF,
                                     tf.int64)])
        u = tf.random.stateless_uniform(tf.shape(x), seed, 1.0 - self.router_jitter,
                                        1.0 + self.router_jitter)
        return tf.cast(u, x.dtype)

    def _dispatch(self, x, plan):
        return constrain(dispatch_tokens(x, plan, self.num_experts), _SLOTS_EMBED, self.name)

    def _experts(self, buffer):
        """(B, E, C, D) -> (B, E, C, D): expert e's SwiGLU on its slots."""
        act = recompute(self.activation) if self.recompute_activation else self.activation
        return self.down(act(self.gate(buffer), self.up(buffer)))  # (B, E, C, F) inside

    def _stats(self, logits, experts, plan, token_mask):
        mask = (tf.ones(tf.shape(logits)[:2], tf.float32) if token_mask is None
                else tf.cast(token_mask, tf.float32))  # (B, T)
        per_choice = tf.reshape(tf.broadcast_to(mask[:, :, None], tf.shape(experts)), [-1])
        counts = tf.math.unsorted_segment_sum(per_choice, tf.reshape(experts, [-1]),
                                              self.num_experts)
        probs = tf.nn.softmax(logits, axis=-1)
        z = tf.square(tf.reduce_logsumexp(logits, axis=-1))  # (B, T)
        dropped = tf.cast(plan.assignment_slot >= self.num_experts * plan.capacity,
                          tf.float32)  # (B, k, T)
        return RouterStats(
            expert_counts=tf.stop_gradient(counts),
            prob_sum=tf.einsum("bte,bt->e", probs, mask),
            num_tokens=tf.reduce_sum(mask),
            z_sum=tf.reduce_sum(z * mask),
            dropped=tf.reduce_sum(dropped * mask[:, None, :]))
