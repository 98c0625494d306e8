"""Memory-efficient attention in plain TensorFlow ops: blocks of queries and keys, an
online softmax, and a backward pass that recomputes each block (FlashAttention's
algorithm, written for XLA and DTensor rather than as a kernel).

Neither pass keeps a (T, S) matrix: the forward pass keeps, per query, its output and the
log-sum-exp of its scores; the backward pass recomputes one (block_q, block_k) tile of
scores at a time from them. Activation memory is linear in the sequence, and key blocks
that the causal mask (or a sliding window) hides from a whole query block are skipped in
both passes.

Numerics: scores, the running maximum, the normalizer and the accumulated output are
float32; the probabilities are cast to the compute dtype for the matmul with the values
(as in `Attention.attend`, whose softmax is float32 and whose probabilities x V runs in
the compute dtype). Only the order of the float32 sums differs from the one-shot softmax.
The backward pass's dP = dO V^T is accumulated and kept in float32 from compute-dtype
operands (`dot_f32`): no GEMM of either pass takes a float32 operand under XLA.

Grouped queries read the (B, S, K, D) keys and values as they are, never repeated per
query head: queries, outputs and their gradients are held head-major (B, K, G, P, L, D).
What the passes cost on an H100 is measured by benchmarks/attention_bytes.py.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import tensorflow as tf

from tfllm import internals

_NEG = -1e30  # not -inf: exp(-inf - -inf) is NaN; a masked score stays finite

# mask_fn(first, stop, key_first, key_stop) -> bool (B or 1, P, t, s) tile of allowed
# (query, key) pairs for queries first .. stop-1 of every piece, or None when all are.
MaskFn = Callable[[int, int, int, int], Optional[tf.Tensor]]
# key_span(first, stop) -> (lowest, highest) key position that queries first .. stop-1 of
# any piece may see: key blocks wholly outside are skipped.
KeySpan = Callable[[int, int], Tuple[int, int]]


def blocks(length: int, size: int) -> List[Tuple[int, int]]:
    """Near-equal static blocks of at most `size` covering 0 .. length-1 (16 by 6: 5, 5, 6)."""
    count = -(-length // size)
    bounds = [length * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def dot_f32(equation: str, a, b):
    """`tf.einsum(equation, a, b)` of compute-dtype operands, accumulated and returned in
    float32: under XLA one GEMM of bf16 operands with a float32 result (a matmul whose
    `Tout` is float32, which only XLA compiles); elsewhere the einsum of the operands cast
    to float32, the same numbers (products of bf16 values are exact in float32).

    The equation contracts one index and has one free index of `b`, its last (as
    "bkgptd,bskd->bkgpts"); every other index of `b` is also `a`'s.
    """
    if a.dtype == tf.float32 or not internals.in_xla_context():
        return tf.einsum(equation, tf.cast(a, tf.float32), tf.cast(b, tf.float32))
    inputs, out = equation.split("->")
    ia, ib = inputs.split(",")
    (contract,) = [c for c in ia if c in ib and c not in out]
    (free_b,) = [c for c in ib if c not in ia]
    batch = [c for c in out if c in ia and c != free_b]  # a's other indices, out's order
    x = tf.transpose(a, [ia.index(c) for c in batch + [contract]])  # (..., M, C)
    y = tf.transpose(b, [ib.index(c) for c in batch if c in ib]
                     + [ib.index(contract), ib.index(free_b)])  # (b's batch, C, N)
    # broadcast b over a's free indices: size-1 axes where b lacks them
    shape = [b.shape[ib.index(c)] if c in ib else 1 for c in batch[:-1]]
    y = tf.reshape(y, shape + [y.shape[-2], y.shape[-1]])
    product = tf.raw_ops.BatchMatMulV3(x=x, y=y, Tout=tf.float32)  # (batch..., M, N)
    have = batch + [free_b]
    return tf.transpose(product, [have.index(c) for c in out])


def flash_attention(q, k, v, *, scale: float, block_q: int, block_k: int,
                    mask_fn: MaskFn, key_span: KeySpan):
    """Attention of q (B, P, L, H, D) over k, v (B, S, K, D) -> (B, P, L, H, D), blockwise.

    The queries come folded by the P pieces their sequence is split into on a mesh (P = 1
    when it is not): a query block takes queries a .. b-1 of every piece, so each device
    attends its own queries and none is gathered. Every query must see at least one key
    (true of causal and packed training masks).

    Args:
      q: queries (B, P, L, H, D).
      k, v: keys and values (B, S, K, D), K dividing H: query head h attends key/value
        head h // (H / K) (grouped queries), without repeating k and v per query head.
      scale: the scores' factor (1 / sqrt(head_dim), or Gemma 3's).
      block_q, block_k: the tile: a pass holds (B, H, P, block_q, block_k) scores at a time.
      mask_fn: the allowed (query, key) pairs of a tile (`MaskFn`).
      key_span: the keys a block of queries may see at all (`KeySpan`).

    Returns:
      The attention output (B, P, L, H, D), in q's dtype.
    """
    batch, pieces, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    q_blocks, k_blocks = blocks(length, block_q), blocks(k.shape[1], block_k)
    visible = []
    for qa, qb in q_blocks:
        low, high = key_span(qa, qb)
        visible.append([j for j, (a, b) in enumerate(k_blocks) if b > low and a <= high])

    def tile_scores(q_i, k_j, qa, qb, ka, kb):
        s = tf.cast(tf.einsum("bkgptd,bskd->bkgpts", q_i, k_j), tf.float32) * scale
        allowed = mask_fn(qa, qb, ka, kb)
        if allowed is not None:
            # expand_dims, not [:, None, None]: DTensor crashes on a StridedSlice with
            # new axes of a sharded (packed) mask (tfllm.models.common.masks)
            allowed = tf.expand_dims(tf.expand_dims(allowed, 1), 1)  # (B, 1, 1, P, t, s)
            s = tf.where(allowed, s, _NEG)
        return s, allowed  # (B, K, G, P, t, s)

    def after(x, previous):
        """x, made to wait for `previous` (an exact + 0 * y, which XLA does not fold): the
        blocks then run one after another instead of side by side with all tiles alive."""
        if previous is None:
            return x
        return x + tf.cast(0.0, x.dtype) * tf.cast(previous, x.dtype)

    # Queries (and outputs, and their gradients) head-major, grouped by the key/value head
    # they attend (h = kv * G + g): (B, P, L, H, D) <-> (B, K, G, P, L, D). In this layout
    # every tile GEMM takes its operands as they are, and the gradients of keys and
    # values contract (g, p, t) in the same order on both sides, so XLA transposes the
    # queries once instead of a (t, s) tile per GEMM.
    def grouped(x):  # (B, P, L, H, D) -> (B, K, G, P, L, D)
        x = tf.reshape(x, (batch, pieces, length, kv_heads, groups, dim))
        return tf.transpose(x, (0, 3, 4, 1, 2, 5))

    def ungrouped(x):  # (B, K, G, P, L, D) -> (B, P, L, H, D)
        x = tf.transpose(x, (0, 3, 4, 1, 2, 5))
        return tf.reshape(x, (batch, pieces, length, heads, dim))

    @tf.custom_gradient
    def attend(q, k, v):
        qg = grouped(q)  # (B, K, G, P, L, D)
        outs, lses, last = [], [], None
        for i, (qa, qb) in enumerate(q_blocks):
            q_i = after(qg[:, :, :, :, qa:qb], last)  # (B, K, G, P, t, D)
            m = l = acc = pv = None
            for j in visible[i]:
                ka, kb = k_blocks[j]
                # tile after tile, too: else XLA computes all of a block's scores first
                # (waiting on the last tile's GEMM output, which a fusion reads directly)
                q_ij = q_i if pv is None else after(q_i, pv[:, :, :, :, -1:])
                s, _ = tile_scores(q_ij, k[:, ka:kb], qa, qb, ka, kb)
                m_new = tf.reduce_max(s, axis=-1, keepdims=True)  # (B, K, G, P, t, 1)
                if m is not None:
                    m_new = tf.maximum(m, m_new)
                p = tf.exp(s - m_new)  # float32
                pv = tf.einsum("bkgpts,bskd->bkgptd", tf.cast(p, v.dtype),
                               v[:, ka:kb])  # (B, K, G, P, t, D)
                if m is None:
                    l = tf.reduce_sum(p, axis=-1, keepdims=True)
                    acc = tf.cast(pv, tf.float32)
                else:
                    alpha = tf.exp(m - m_new)  # rescales what the earlier key blocks gave
                    l = l * alpha + tf.reduce_sum(p, axis=-1, keepdims=True)
                    acc = acc * alpha + tf.cast(pv, tf.float32)
                m = m_new
            outs.append(acc / l)  # (B, K, G, P, t, D) float32
            lses.append(m + tf.math.log(l))  # (B, K, G, P, t, 1)
            last = outs[-1][:, :, :, :, -1:]
        out32 = tf.concat(outs, axis=4)  # (B, K, G, P, L, D)
        out = ungrouped(tf.cast(out32, q.dtype))
        lse = tf.concat(lses, axis=4)  # (B, K, G, P, L, 1)

        def grad(d_out):
            dog = grouped(tf.cast(d_out, q.dtype))  # (B, K, G, P, L, D)
            # the softmax's correction term, per query: sum_d dO * O (B, K, G, P, L, 1),
            # from the float32 output (O rounded to bf16 here doubled the gradients' error)
            delta = tf.reduce_sum(tf.cast(dog, tf.float32) * out32, -1, keepdims=True)
            dq = []
            dk = [tf.zeros(k[:, a:b].shape, tf.float32) for a, b in k_blocks]
            dv = [tf.zeros(v[:, a:b].shape, tf.float32) for a, b in k_blocks]
            for i, (qa, qb) in enumerate(q_blocks):
                q_i = qg[:, :, :, :, qa:qb]  # (B, K, G, P, t, D)
                do_i = after(dog[:, :, :, :, qa:qb], dq[-1][:, :, :, :, -1:] if dq else None)
                lse_i, delta_i = lse[:, :, :, :, qa:qb], delta[:, :, :, :, qa:qb]  # (B,K,G,P,t,1)
                dq_i, dq_ij = tf.zeros(q_i.shape, tf.float32), None
                for j in visible[i]:
                    ka, kb = k_blocks[j]
                    k_j, v_j = k[:, ka:kb], v[:, ka:kb]
                    # tile after tile, waiting on the last tile's GEMM output
                    previous = None if dq_ij is None else dq_ij[:, :, :, :, -1:]
                    q_ij, do_ij = after(q_i, previous), after(do_i, previous)
                    s, allowed = tile_scores(q_ij, k_j, qa, qb, ka, kb)
                    p = tf.exp(s - lse_i)  # the forward pass's probabilities, recomputed
                    if allowed is not None:
                        p = tf.where(allowed, p, 0.0)
                    dv[j] += tf.cast(tf.einsum("bkgpts,bkgptd->bskd", tf.cast(p, v.dtype),
                                               do_ij), tf.float32)
                    # dP accumulated and kept in float32 (as FlashAttention's
                    # accumulators) from compute-dtype operands: rounded to the compute
                    # dtype, its error is not cancelled by delta, computed from O, and
                    # dP - delta cancels (bf16 gradients: 1.4x the one-shot error; dP -
                    # delta in one GEMM, delta as bf16 hi + lo columns: 1.6x)
                    dp = dot_f32("bkgptd,bskd->bkgpts", do_ij, v_j)  # (B, K, G, P, t, s)
                    ds = tf.cast(p * (dp - delta_i) * scale, q.dtype)
                    dq_ij = tf.einsum("bkgpts,bskd->bkgptd", ds, k_j)  # (B, K, G, P, t, D)
                    dq_i += tf.cast(dq_ij, tf.float32)
                    dk[j] += tf.cast(tf.einsum("bkgpts,bkgptd->bskd", ds, q_ij), tf.float32)
                dq.append(tf.cast(dq_i, q.dtype))
            return (ungrouped(tf.concat(dq, axis=4)), tf.cast(tf.concat(dk, axis=1), k.dtype),
                    tf.cast(tf.concat(dv, axis=1), v.dtype))

        return out, grad

    return attend(q, k, v)
