"""`CausalLM`: the base Keras model that GPT, Llama and users' models subclass.

The model is written for one device; it names logical axes only (see
`tfllm.parallel.rules`). Subclasses change behaviour by overriding hooks:

* `make_norm(name)`, `make_attention(index)`, `make_mlp(index)`: the sublayers;
* `make_block(index)`: a whole transformer block (default: pre-norm residual);
* `embed(token_ids)`: token ids (B, T) -> hidden (B, T, E);
* `head(hidden)`: hidden (B, T, E) -> logits (B, T, V) in float32;
* `compute_lm_loss(logits, targets, mask)`: the training loss.

`call(token_ids, segment_ids=None)` is the training forward (segment ids: packed
documents); `init_cache` and `call_with_cache` are the decoding path that
`tfllm.generate.Generator` drives.

Example, replacing the MLP of every block:

    class MyLM(tfllm.models.Llama):
        def make_mlp(self, index):
            return MyMLP(self.config.hidden_dim, name="mlp")

Build a model with `tfllm.models.build_model(config.model, config.precision, config.lora,
parallel=parallel, seed=config.train.seed)` so that its variables are created in their
DTensor layouts.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tfllm.config.schema import ModelConfig
from tfllm.models.common import moe
from tfllm.models.common.layers import Projection, TokenEmbedding
from tfllm.models.common.masks import (cache_mask_and_positions, row_positions,
                                       segment_mask_and_positions)
from tfllm.models.common.remat import check_policy, recompute, recomputing
from tfllm.models.loss import token_nll
from tfllm.parallel.context import block_weights, constrain

_EMBED = ("activation_batch", "activation_length", "activation_embed")
# Cache slots are never split: decoding writes one slot at a time.
_KV_CACHE = ("activation_batch", None, "activation_kv_heads",
             "activation_head_dim")


class Block(keras.layers.Layer):
    """Pre-norm transformer block: x + attn(norm1(x)), then + mlp(norm2(x)); with post
    norms (Gemma), x + post1(attn(norm1(x))), then + post2(mlp(norm2(x))).

    Args:
      attention, mlp, attention_norm, mlp_norm: the sublayers.
      attention_post_norm, mlp_post_norm: norms of the sublayers' outputs, or None.
    """

    def __init__(self, attention, mlp, attention_norm, mlp_norm, attention_post_norm=None,
                 mlp_post_norm=None, **kwargs):
        super().__init__(**kwargs)
        self.attention_norm, self.attention = attention_norm, attention
        self.mlp_norm, self.mlp = mlp_norm, mlp
        self.attention_post_norm, self.mlp_post_norm = attention_post_norm, mlp_post_norm

    def build(self, input_shape=None):
        for layer in (self.attention_norm, self.attention, self.attention_post_norm,
                      self.mlp_norm, self.mlp, self.mlp_post_norm):
            if layer is not None:
                layer.build(None)

    def call(self, x, attention_mask=None, positions=None, cache=None, cache_index=None,
             token_mask=None):
        """x (B, T, E) -> (B, T, E); with a cache, ((B, T, E), the attention's new cache).

        The optional arguments go to the attention (see `Attention.call`) only when given,
        so an attention layer of a subclass needs them only for packing or decoding;
        `token_mask` (B, T) to a mixture of experts' router statistics (padding is not
        counted, as transformers' aux loss skips attention_mask's zeros).
        """
        extra = {k: v for k, v in (("attention_mask", attention_mask),
                                   ("positions", positions), ("cache", cache),
                                   ("cache_index", cache_index)) if v is not None}
        h = self.attention(self.attention_norm(x), **extra)
        if cache is not None:
            h, cache = h
        if self.attention_post_norm is not None:
            h = self.attention_post_norm(h)
        x = constrain(x + h, _EMBED)
        sparse = token_mask is not None and isinstance(self.mlp, moe.MoeMLP)
        h = (self.mlp(self.mlp_norm(x), token_mask=token_mask) if sparse
             else self.mlp(self.mlp_norm(x)))
        if isinstance(h, tuple):  # a mixture of experts: (y, RouterStats)
            h, stats = h
            moe.record([stats])
        if self.mlp_post_norm is not None:
            h = self.mlp_post_norm(h)
        x = constrain(x + h, _EMBED)
        return x if cache is None else (x, cache)


class CausalLM(keras.Model):
    """A decoder-only language model: embed, blocks, final norm, LM head.

    Args:
      config: the model section of the tfllm config.
      dtype: a Keras dtype policy name ("float32", "mixed_bfloat16", "mixed_float16").
      fp8: `tfllm.precision.Fp8Settings` to run the attention and MLP projections in FP8
        (pass `fp8=self.fp8, fp8_path=...` on to them: in the `AttentionSettings` of
        `make_attention`, to the MLP of `make_mlp`).
    """

    #: defaults a family may set for config fields left null
    family_defaults = {"tie_embeddings": False, "use_bias": False}

    def __init__(self, config: ModelConfig, dtype="float32", fp8=None, **kwargs):
        super().__init__(dtype=dtype, **kwargs)
        self.config = config
        self.fp8 = fp8
        c = config
        self.tie_embeddings = (self.family_defaults["tie_embeddings"]
                               if c.tie_embeddings is None else c.tie_embeddings)
        self.use_bias = self.family_defaults["use_bias"] if c.use_bias is None else c.use_bias
        self.num_key_value_heads = c.num_key_value_heads or c.num_query_heads
        self.head_dim = c.head_dim or c.hidden_dim // c.num_query_heads
        # GPT-2's depth-scaled init of the projections that write into the residual stream.
        self.output_init_std = c.init_std / math.sqrt(2 * c.num_layers)
        self.token_embedding = TokenEmbedding(c.vocab_size, c.hidden_dim, c.init_std,
                                              name="token_embedding", dtype=dtype)
        self.blocks = [self.make_block(i) for i in range(c.num_layers)]
        self.final_norm = self.make_norm("final_norm")
        self.remat = check_policy(getattr(c, "remat", "none"))
        self.apply_remat(self.remat)
        self.lm_head = None
        if not self.tie_embeddings:
            self.lm_head = Projection("btd,dv->btv", (c.hidden_dim, c.vocab_size),
                                      ("embed", "vocab"), init_std=c.init_std,
                                      output_axes=("activation_batch", "activation_length",
                                                   "activation_vocab"),
                                      name="lm_head", dtype=dtype)

    # ---- hooks for subclasses -------------------------------------------------------------
    def make_norm(self, name: str) -> keras.layers.Layer:
        """The normalization layer used before attention, MLP and the head."""
        raise NotImplementedError("CausalLM subclasses define make_norm")

    def make_attention(self, index: int) -> keras.layers.Layer:
        """The attention layer of block `index`: (B, T, E) -> (B, T, E)."""
        raise NotImplementedError("CausalLM subclasses define make_attention")

    def make_mlp(self, index: int) -> keras.layers.Layer:
        """The feed-forward layer of block `index`: (B, T, E) -> (B, T, E)."""
        raise NotImplementedError("CausalLM subclasses define make_mlp")

    def make_block(self, index: int) -> keras.layers.Layer:
        """Transformer block `index`; by default pre-norm attention then MLP."""
        return Block(self.make_attention(index), self.make_mlp(index),
                     self.make_norm("attention_norm"), self.make_norm("mlp_norm"),
                     name=f"block_{index}", dtype=self.dtype_policy)

    def embed(self, token_ids, positions=None):
        """Token ids (B, T) -> hidden states (B, T, E).

        Args:
          token_ids: (B, T) int.
          positions: (B, T) int position of each token (packed documents, cached
            decoding), or None for 0 .. T-1; families with learned positions use it.
        """
        return self.token_embedding(token_ids)

    def head(self, hidden):
        """Hidden (B, T, E) -> float32 logits (B, T, V)."""
        if self.tie_embeddings:
            logits = self.token_embedding.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return tf.cast(logits, tf.float32)

    def compute_lm_loss(self, logits, targets, mask=None):
        """Mean next-token cross-entropy over unmasked positions, in float32.

        Args:
          logits: (B, T, V) float32.
          targets: (B, T) int token ids.
          mask: (B, T) 1 where the position counts, or None for all.
        """
        nll = token_nll(logits, targets)  # (B, T)
        if mask is None:
            return tf.reduce_mean(nll)
        mask = tf.cast(mask, tf.float32)
        return tf.reduce_sum(nll * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)

    def apply_remat(self, policy: str) -> None:
        """Marks the sublayers that recompute their activations under `policy` (see
        `tfllm.models.common.remat`); `full` is applied per block in `call`. Layers of a
        subclass without the flags are simply kept."""
        selective, attention = policy == "selective", policy in ("selective", "attention")
        for block in self.blocks:
            for norm in (getattr(block, name, None) for name in (
                    "attention_norm", "mlp_norm", "attention_post_norm", "mlp_post_norm")):
                if hasattr(norm, "recompute"):
                    norm.recompute = selective
            if hasattr(getattr(block, "attention", None), "recompute_core"):
                block.attention.recompute_core = attention
            if hasattr(getattr(block, "mlp", None), "recompute_activation"):
                block.mlp.recompute_activation = selective
        if hasattr(self.final_norm, "recompute"):
            self.final_norm.recompute = selective

    def run_block(self, block, x, mask=None, positions=None, ahead=None, token_mask=None):
        """One block of the training forward; under remat=full, recomputed in backward
        (`tfllm.plan.block_program` compiles one on its own).

        The block's weights move together (`block_weights`): gathered at once after
        `ahead`, the previous block's input, so they travel while that block computes and
        no earlier; their gradients are reduced together.
        """
        full = self.remat == "full"

        def run(x, mask, positions, token_mask):
            # A recomputed block gathers its weights after its gradient arrives (x, in a
            # recomputation, waits for it): they are not kept from the forward pass.
            gate = (x,) if recomputing() or ahead is None else (ahead,)
            # A mixture of experts' router statistics leave the block as its outputs, so
            # that under full remat the aux loss's gradient reaches the router through
            # the recomputation (`tfllm.models.common.moe.collecting_router_stats`).
            with block_weights(block, x, gate, regather=not full), \
                    moe.collecting_router_stats() as stats:
                y = block(x, attention_mask=mask, positions=positions,
                          token_mask=token_mask)
            return (y, stats) if stats else y

        args = (x, mask, positions, token_mask)
        out = recompute(run)(*args) if full else run(*args)
        if isinstance(out, tuple):
            out, stats = out
            moe.record(stats)
        return out

    def router_losses(self, stats):
        """What the router statistics of a training forward pass add to its loss, and
        their metrics (`tfllm.models.common.moe.router_losses` with model.
        router_aux_loss_coef and router_z_loss_coef).

        Args:
          stats: the `RouterStats` collected over the forward pass (non-empty).
        """
        c = self.config
        return moe.router_losses(stats, c.router_aux_loss_coef, c.router_z_loss_coef)

    def fp8_state_variables(self) -> list:
        """The FP8 amax histories: updated by the train step, never by the optimizer."""
        return [v for v in self.variables if getattr(v, "kind", None) == "fp8_state"]

    # ---- Keras --------------------------------------------------------------------------
    def build(self, input_shape=None):
        self.token_embedding.build(None)
        for block in self.blocks:
            block.build(None)
        self.final_norm.build(None)
        if self.lm_head is not None:
            self.lm_head.build(None)
        self.built = True

    def call(self, token_ids, segment_ids=None):
        """Token ids (B, T) -> float32 logits (B, T, V).

        Args:
          token_ids: (B, T) int.
          segment_ids: (B, T) int document ids of packed rows, or None. When given,
            attention stays within each document and positions restart at 0 at each
            document's start; None is plain causal attention over the whole row.
        """
        token_mask = None
        if segment_ids is not None:
            mask, positions = segment_mask_and_positions(segment_ids)
            x = self.embed(token_ids, positions=positions)
            if self.config.num_experts:  # padding (segment 0) routes but is not counted
                token_mask = segment_ids > 0  # bool: no gradient under recompute
        else:
            # 0 .. T-1, computed in the program (`row_positions`): the blocks' RoPE
            # tables and causal masks are then no folded constants. The embedding keeps
            # its slice (learned positions: a gather would change its gradient's ops).
            mask, positions = None, row_positions(token_ids)
            x = self.embed(token_ids)
        previous = None
        for block in self.blocks:
            x, previous = self.run_block(block, x, mask, positions, ahead=previous,
                                         token_mask=token_mask), x
        # The final norm and an untied head move together like a block (the tied table
        # is the embedding's: gathered where it is used).
        head_layers = [self.final_norm] + ([] if self.tie_embeddings else [self.lm_head])
        with block_weights(head_layers, x, (previous,)):
            return self.head(self.final_norm(x))

    # ---- cached decoding ----------------------------------------------------------------
    def init_cache(self, batch_size: int, cache_length: int):
        """Zero key/value caches: one (keys, values) pair per block, each (B, S, K, D).

        Args:
          batch_size: B.
          cache_length: S, the number of token slots (prompt plus generated tokens).
        """
        shape = (batch_size, cache_length, self.num_key_value_heads, self.head_dim)
        zeros = lambda: constrain(tf.zeros(shape, self.compute_dtype), _KV_CACHE, "kv_cache")
        return [(zeros(), zeros()) for _ in self.blocks]

    def call_with_cache(self, token_ids, cache, cache_index, batch_start=None,
                        last_only: bool = False):
        """Runs `token_ids` written at cache slots index .. index+T-1 against the cache.

        Args:
          token_ids: (B, T) int new tokens (the whole prompt to prefill, or one token).
          cache: from `init_cache` or a previous call.
          cache_index: int32 scalar, the slot of the first new token.
          batch_start: (B,) int32 first real slot of each left-padded row (its position
            0), or None when no row is padded.
          last_only: compute logits for the last new token only (prefill needs no more).

        Returns:
          (float32 logits (B, T, V), or (B, 1, V) with last_only; the updated cache).
        """
        batch, length = token_ids.shape[0], token_ids.shape[1]
        cache_length = cache[0][0].shape[1]
        if batch_start is None:
            batch_start = tf.zeros((batch,), tf.int32)
        cache_index = tf.cast(cache_index, tf.int32)
        mask, positions = cache_mask_and_positions(batch_start, cache_index, length,
                                                   cache_length)
        x = self.embed(token_ids, positions=positions)
        new_cache = []
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block(x, attention_mask=mask, positions=positions,
                                   cache=layer_cache, cache_index=cache_index)
            new_cache.append(layer_cache)
        if last_only:
            x = x[:, -1:]  # (B, 1, E)
        return self.head(self.final_norm(x)), new_cache
