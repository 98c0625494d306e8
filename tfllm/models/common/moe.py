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

Dispatch (`tfllm.models.common.dispatch`), per sequence, both dropless by default:
`dispatch="slots"` fills C slots per expert (a (B, E, C, D) buffer, batched einsums over
E; dropless C = T costs E/k times the active FLOPs; a `capacity_factor` drops the
assignments past C, as GShard and Switch do: see that module for exactly which);
`dispatch="grouped"` sorts the tokens into expert tiles for a grouped matmul
(`tfllm.models.common.grouped`), the active FLOPs plus tile padding, one device or FSDP
only. Slots are what expert parallelism relayouts (the all-to-all).

LoRA on the experts (`tfllm.models.lora`): gate, up and down carry per-expert adapters,
A (E, in, r) and B (r, E, out), laid out as their kernels; up takes gate's hidden x A
(peft's one A of transformers' fused gate_up_proj), computed once for both, in either
dispatch (the grouped one as two more grouped products per projection).

The block returns `(y, RouterStats)`: the statistics `load_balancing_loss` combines over
layers exactly as transformers' `load_balancing_loss_func` does, the router z-loss and
per-expert assignment counts for metrics.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from typing import List, NamedTuple, Optional, Sequence

import keras
import tensorflow as tf

from tfllm.models.common import adapters, noise
from tfllm.models.common.dispatch import (expert_capacity, gather_back, gather_rows,
                                          plan_grouped, plan_slots)
from tfllm.models.common.grouped import grouped_matmul
from tfllm.models.common.layers import Projection
from tfllm.models.common.mlp import GATED_ACTIVATIONS, GatedMLP
from tfllm.models.common.remat import recompute
from tfllm.parallel.context import constrain, weight_product

ROUTINGS = ("topk_then_softmax", "softmax_then_topk")
DISPATCHES = ("slots", "grouped")

_EMBED = ("activation_batch", "activation_length", "activation_embed")
_LOGITS = ("activation_batch", "activation_length", None)
# The dispatched buffers on the tokens' side (B, E, C, .): rows, experts, slots, features;
# the batch's rows come first and take the batch's mesh axis.
_SLOTS_EMBED = ("activation_batch", "activation_experts", None, "activation_embed")
# The same buffers on the experts' side (E, B, C, .): the experts come first and take
# that axis when the rules split the experts over it (expert parallelism), so the
# relayout between the two sides is one all-to-all each way; else both sides lie alike
# and the transposes between them are local.
_EXPERTS_EMBED = ("activation_experts", "activation_batch", None, "activation_embed")
_EXPERTS_MLP = ("activation_experts", "activation_batch", None, "activation_mlp")
# The grouped rows (B, R, .): sorted by expert, so no axis is the experts'.
_ROWS_EMBED = ("activation_batch", None, "activation_embed")


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


_collector = threading.local()


@contextlib.contextmanager
def collecting_router_stats():
    """Inside, every MoE block that runs appends its `RouterStats` (`record`) to the list
    this yields: the train step collects a forward pass's, and a block recomputed under
    full remat collects its own to return them as outputs of the recomputed function
    (`CausalLM.run_block`). Outside, they are dropped (generation, evaluation)."""
    previous = getattr(_collector, "stats", None)
    _collector.stats = stats = []
    try:
        yield stats
    finally:
        _collector.stats = previous


def record(stats: Sequence[RouterStats]) -> None:
    """Hands `stats` to the innermost `collecting_router_stats`, if any."""
    target: Optional[List[RouterStats]] = getattr(_collector, "stats", None)
    if target is not None:
        target.extend(stats)


def router_losses(stats: Sequence[RouterStats], aux_loss_coef: float,
                  z_loss_coef: float = 0.0):
    """What a forward pass's routing adds to the loss, and its metrics.

    Args:
      stats: the `RouterStats` of every MoE block of the forward pass.
      aux_loss_coef: times `load_balancing_loss` (`router_aux_loss_coef`).
      z_loss_coef: times `router_z_loss`.

    Returns:
      (the float32 loss term, {name: float32 scalar}): `moe_aux_loss` (the unscaled
      load-balancing loss: 1 when balanced, up to num_experts when one expert takes every
      token), `moe_z_loss`, `moe_load_imbalance` (the most loaded expert's assignments
      over the mean, in the most imbalanced layer: 1 when balanced),
      `moe_dropped_fraction` (assignments dropped for capacity over all assignments) and
      `moe_expert_tokens` ((sparse layers, E): each expert's assignments, its top-k
      choices before any drop; a step sums it over its micro-batches,
      `SUMMED_METRICS`).
    """
    aux, z = load_balancing_loss(stats), router_z_loss(stats)
    imbalance = tf.reduce_max(tf.stack([
        tf.reduce_max(s.expert_counts) / tf.maximum(tf.reduce_mean(s.expert_counts), 1e-9)
        for s in stats]))
    assignments = tf.add_n([tf.reduce_sum(s.expert_counts) for s in stats])
    dropped = tf.add_n([s.dropped for s in stats]) / tf.maximum(assignments, 1.0)
    loss = aux_loss_coef * aux + (z_loss_coef * z if z_loss_coef else 0.0)
    return loss, {"moe_aux_loss": aux, "moe_z_loss": z,
                  "moe_load_imbalance": tf.stop_gradient(imbalance),
                  "moe_dropped_fraction": tf.stop_gradient(dropped),
                  "moe_expert_tokens": tf.stop_gradient(
                      tf.stack([s.expert_counts for s in stats]))}


#: router metrics a step sums over its micro-batches (the others it averages)
SUMMED_METRICS = frozenset({"moe_expert_tokens"})


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


def _top_k(x, k: int):
    """tf.math.top_k whose values differentiate by a one-hot product, not top_k's gradient:
    that is a scatter into the flattened input with offsets from its shape, which on a
    batch-sharded DTensor is the global shape while each device holds its own rows (out
    of range). x * 1 + 0 * the others: the same values bit for bit."""
    _, experts = tf.math.top_k(tf.stop_gradient(x), k)  # (..., k)
    pick = tf.one_hot(experts, x.shape[-1], dtype=x.dtype)  # (..., k, E)
    return tf.reduce_sum(pick * x[..., None, :], axis=-1), experts


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
        values, experts = _top_k(logits, top_k)
        return tf.nn.softmax(values, axis=-1), experts
    values, experts = _top_k(tf.nn.softmax(logits, axis=-1), top_k)
    if normalize_top_k:
        values = values / tf.reduce_sum(values, axis=-1, keepdims=True)
    return values, experts


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
      capacity_factor: None for dropless dispatch, else the capacity factor
        (`dispatch="slots"` only; `tfllm.models.common.dispatch`: what is dropped).
      dispatch: "slots" (an (E, C) buffer per row) or "grouped" (expert tiles and a
        grouped matmul; dropless only).
      tile: rows per tile of the grouped dispatch (at most T are used).
      router_jitter: in training, multiply the tokens by U(1 - j, 1 + j) before routing
        and the experts (transformers' Mixtral `router_jitter_noise`; 0 = off).
      shared_intermediate_dim: width of Qwen2-MoE's shared expert, gated by
        sigmoid(x w), added to every token's output; None = no shared expert.
      activation: the experts' gated activation (see `GATED_ACTIVATIONS`).
      init_std: init of the router, gate and up.
      output_init_std: init of down (scaled for depth).
      fp8: `Fp8Settings` to run the expert GEMMs (gate, up, down; and the shared
        expert's) in FP8 with `dispatch="slots"`, or None. The router stays in the
        compute dtype: its k-of-E choice is a comparison of logits that FP8's 3
        mantissa bits would flip for near ties.
      fp8_path: this layer's path for `fp8.exclude` (e.g. "block_1/mlp").
    """

    def __init__(self, hidden_dim: int, intermediate_dim: int, num_experts: int,
                 top_k: int, routing: str = "softmax_then_topk",
                 normalize_top_k: bool = True, capacity_factor: Optional[float] = None,
                 dispatch: str = "slots", tile: int = 64,
                 router_jitter: float = 0.0, shared_intermediate_dim: Optional[int] = None,
                 activation: str = "silu", init_std: float = 0.02,
                 output_init_std: float = 0.02, fp8=None, fp8_path: str = "mlp",
                 **kwargs):
        super().__init__(**kwargs)
        if routing not in ROUTINGS:
            raise ValueError(f"{self.name}: routing {routing!r}; use one of {ROUTINGS}.")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{self.name}: top_k={top_k} with {num_experts} experts; "
                             "choose 1 <= top_k <= num_experts.")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"{self.name}: capacity_factor={capacity_factor}; use a "
                             "positive factor, or None for dropless dispatch.")
        if dispatch not in DISPATCHES:
            raise ValueError(f"{self.name}: dispatch {dispatch!r}; use one of {DISPATCHES}.")
        if dispatch == "grouped" and capacity_factor is not None:
            raise ValueError(f"{self.name}: the grouped dispatch is dropless; set "
                             "capacity_factor=None, or dispatch='slots' to drop.")
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"{self.name}: activation {activation!r}; use one of "
                             f"{sorted(GATED_ACTIVATIONS)}.")
        fp8_for = lambda name: fp8.for_layer(f"{fp8_path}/{name}") if fp8 else None  # noqa: E731
        if dispatch == "grouped" and any(fp8_for(n) for n in ("gate", "up", "down")):
            raise ValueError(f"{self.name}: FP8 expert GEMMs need dispatch='slots' (the "
                             "grouped matmul has no FP8 form); set model.moe_dispatch=slots "
                             "or exclude the MoE blocks from FP8 (precision.fp8_exclude).")
        self.hidden_dim, self.intermediate_dim = hidden_dim, intermediate_dim
        self.num_experts, self.top_k = num_experts, top_k
        self.routing, self.normalize_top_k = routing, normalize_top_k
        self.capacity_factor, self.router_jitter = capacity_factor, router_jitter
        self.dispatch, self.tile = dispatch, tile
        self.activation = GATED_ACTIVATIONS[activation]
        self.recompute_activation = False  # set by the model's remat policy
        d, f, e = hidden_dim, intermediate_dim, num_experts
        policy = self.dtype_policy
        # The router is small and every token needs all of its E columns: never sharded.
        self.router = Projection("btd,de->bte", (d, e), ("embed", None), init_std=init_std,
                                 output_axes=_LOGITS, name="router", dtype=policy)
        # Each expert projection is one batched einsum over E: with FP8 one GEMM per
        # projection, its operands scaled per tensor (all experts' tokens share the
        # input's scale, all experts' kernels the weight's), as for a dense projection.
        # Experts-major (E, B, C, .) operands: see `_slot_experts`.
        kw = dict(init_std=init_std, output_axes=_EXPERTS_MLP, dtype=policy)
        self.gate = Projection("ebcd,edf->ebcf", (e, d, f), ("experts", "embed", "mlp"),
                               name="gate", fp8=fp8_for("gate"), **kw)
        self.up = Projection("ebcd,edf->ebcf", (e, d, f), ("experts", "embed", "mlp"),
                             name="up", fp8=fp8_for("up"), **kw)
        self.down = Projection("ebcf,efd->ebcd", (e, f, d), ("experts", "mlp", "embed"),
                               init_std=output_init_std, output_axes=_EXPERTS_EMBED,
                               name="down", fp8=fp8_for("down"), dtype=policy)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_dim is not None:
            self.shared_expert = GatedMLP(d, shared_intermediate_dim, init_std=init_std,
                                          output_init_std=output_init_std,
                                          activation=activation, name="shared_expert",
                                          fp8=fp8, fp8_path=f"{fp8_path}/shared_expert",
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
        if self.dispatch == "grouped":
            # An expert holds at most T assignments of a row: a longer tile is padding
            # only (decoding one token: k tiles of one row).
            plan = plan_grouped(experts, self.num_experts, min(self.tile, length))
            out = self._grouped_experts(constrain(gather_rows(x, plan), _ROWS_EMBED), plan)
        else:
            plan = plan_slots(experts, self.num_experts, expert_capacity(
                length, self.top_k, self.num_experts, self.capacity_factor))
            out = self._slot_experts(gather_rows(x, plan), plan)
        y = gather_back(out, plan, weights)
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

    def _activation(self):
        return recompute(self.activation) if self.recompute_activation else self.activation

    def _slot_experts(self, rows, plan):
        """(B, E*C, D) -> (B, E*C, D): expert e's SwiGLU on its C slots.

        Expert parallelism is the two relayouts: the buffer, laid out by its rows on the
        tokens' side, is laid out by its experts for the products (an all-to-all over
        the batch's mesh axis: each device sends every other device the slots of that
        device's experts, B/n x E/n x C x D elements, and receives its experts' slots of
        every row), and the outputs come back the same way. Both move the compute dtype
        (a bfloat16 buffer as float16 bits: `constrain`); their gradients are the same
        all-to-alls backwards. Without expert parallelism both sides lie alike.
        """
        buffer = constrain(tf.reshape(rows, [-1, self.num_experts, plan.capacity,
                                             self.hidden_dim]), _SLOTS_EMBED, self.name)
        at_experts = constrain(tf.transpose(buffer, [1, 0, 2, 3]), _EXPERTS_EMBED,
                               self.name)  # (E, B, C, D): the all-to-all
        h = self._shared_hidden(at_experts, self.gate.lora_hidden)
        hidden = self._activation()(self.gate(at_experts, lora_hidden=h),
                                    self.up(at_experts, lora_hidden=h))
        out = self.down(hidden)  # (E, B, C, D)
        back = constrain(tf.transpose(out, [1, 0, 2, 3]), _SLOTS_EMBED,
                         self.name)  # (B, E, C, D): the all-to-all back
        return tf.reshape(back, tf.shape(rows))

    def _shared_hidden(self, x, hidden):
        """The gate's adapter hidden x A (`hidden(x)`) when up shares its A (LoRA on
        the experts, peft's one A of gate_up_proj): computed once for both; else None."""
        if self.up.lora is None or not self.up.lora.shares_a or adapters.disabled():
            return None
        return hidden(x)

    def _grouped_experts(self, rows, plan):
        """(B, R, D) -> (B, R, D): each tile through its expert's SwiGLU (and its
        adapters: x A_e then B_e, each a grouped product over the same tiles)."""
        def grouped(x, w, axes, name, perm=None):
            def fn(x, w):
                w = w if perm is None else tf.transpose(w, perm)
                return grouped_matmul(x, w, plan.tile_expert, plan.tile)
            return weight_product(fn, x, w, axes, name)

        def hidden_of(projection):
            # dropout is refused with expert adapters (tfllm.models.lora.targeted)
            return lambda x: grouped(x, projection.lora_a, projection.lora_a.logical_axes,
                                     projection.name)  # (B, R, r)

        def product(projection, x, h=None):
            y = grouped(x, projection.kernel, projection.kernel_axes, projection.name)
            if projection.lora is None or adapters.disabled():
                return y
            if h is None:
                h = hidden_of(projection)(x)
            # B (r, E, out) as the grouped product's (E, r, out)
            delta = grouped(h, projection.lora_b, projection.lora_b.logical_axes,
                            projection.name, perm=[1, 0, 2])
            return y + delta * tf.cast(projection.lora.scale, delta.dtype)

        h = self._shared_hidden(rows, hidden_of(self.gate))
        hidden = self._activation()(product(self.gate, rows, h), product(self.up, rows, h))
        return product(self.down, hidden)

    def _stats(self, logits, experts, plan, token_mask):
        mask = (tf.ones(tf.shape(logits)[:2], tf.float32) if token_mask is None
                else tf.cast(token_mask, tf.float32))  # (B, T)
        # A sum of one-hots, local to each device's rows before the (E,) reduction (a
        # segment sum over the flattened batch all-gathered every row's routing).
        counts = tf.einsum("btke,bt->e", tf.one_hot(experts, self.num_experts,
                                                    dtype=tf.float32), mask)
        probs = tf.nn.softmax(logits, axis=-1)
        z = tf.square(tf.reduce_logsumexp(logits, axis=-1))  # (B, T)
        dropped = tf.cast(plan.assignment_row >= plan.row_token.shape[1],
                          tf.float32)  # (B, k, T)
        return RouterStats(
            expert_counts=tf.stop_gradient(counts),
            prob_sum=tf.einsum("bte,bt->e", probs, mask),
            num_tokens=tf.reduce_sum(mask),
            z_sum=tf.reduce_sum(z * mask),
            dropped=tf.reduce_sum(dropped * mask[:, None, :]))
