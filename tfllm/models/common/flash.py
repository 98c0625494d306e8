"""Memory-efficient attention in plain TensorFlow ops: blocks of queries and keys, an
online softmax, and a backward pass that recomputes each block (FlashAttention's
algorithm, written for XLA and DTensor rather than as a kernel).

Neither pass keeps a (T, S) matrix: the forward pass keeps, per query, its output and the
log-sum-exp of its scores; the backward pass recomputes one tile of scores at a time from
them. A tile is a block of queries against the keys it may see (up to `max_keys`): one
GEMM and one softmax for a whole row of (block_q, block_k) units. Activation memory is
linear in the sequence, and key blocks that the causal mask (or a sliding window) hides
from a whole query block are skipped in both passes.

Numerics: scores and dP = dO V^T leave their GEMMs in the compute dtype, as in
`Attention.attend` (whose score GEMM returns bf16 and whose autodiff gradient of P x V
does); the softmax, the running maximum, the normalizer, the accumulated output and the
sums of gradients across tiles are float32; P and dS are cast to the compute dtype for
their GEMMs. No GEMM of either pass takes a float32 operand. A whole row of tiles takes
the softmax's correction term from the rounded dP, as the one-shot softmax's gradient
does (the rounding then cancels); tiles with an online softmax take it from the float32
output (FlashAttention's delta).

Grouped queries read the (B, S, K, D) keys and values as they are, never repeated per
query head: queries, outputs and their gradients are held head-major (B, K, G, P, L, D).
What the passes cost on an H100 is measured by benchmarks/attention_bytes.py.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import tensorflow as tf

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


def chunks(spans: List[Tuple[int, int]], max_keys: int) -> List[Tuple[int, int]]:
    """Consecutive key blocks `spans` grouped into chunks of at most `max_keys` keys (at
    least one block each): the key ranges one score tile of a query block covers."""
    out = []
    for a, b in spans:
        if out and b - out[-1][0] <= max_keys:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def flash_attention(q, k, v, *, scale: float, block_q: int, block_k: int,
                    mask_fn: MaskFn, key_span: KeySpan, max_keys: Optional[int] = None):
    """Attention of q (B, P, L, H, D) over k, v (B, S, K, D) -> (B, P, L, H, D), blockwise.

    The queries come folded by the P pieces their sequence is split into on a mesh (P = 1
    when it is not): a query block takes queries a .. b-1 of every piece, so each device
    attends its own queries and none is gathered. Every query must see at least one key
    (true of causal and packed training masks).

    A query block sees the key blocks (of `block_k`) that its span admits; consecutive
    ones are joined into one score tile of up to `max_keys` keys (a row of tiles), so that
    each GEMM and each softmax fusion serves many (block_q, block_k) units: with
    `max_keys` >= the sequence a query block's whole row is one tile, its softmax exact in
    one pass (no online rescaling), its dQ one GEMM.

    Args:
      q: queries (B, P, L, H, D).
      k, v: keys and values (B, S, K, D), K dividing H: query head h attends key/value
        head h // (H / K) (grouped queries), without repeating k and v per query head.
      scale: the scores' factor (1 / sqrt(head_dim), or Gemma 3's).
      block_q, block_k: the query block and the key blocks that are skipped when hidden.
      mask_fn: the allowed (query, key) pairs of a tile (`MaskFn`).
      key_span: the keys a block of queries may see at all (`KeySpan`).
      max_keys: the most keys of one score tile (default `block_k`: one key block): a
        pass holds (B, H, P, block_q, max_keys) scores at a time.

    Returns:
      The attention output (B, P, L, H, D), in q's dtype.
    """
    batch, pieces, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    q_blocks, k_blocks = blocks(length, block_q), blocks(k.shape[1], block_k)
    tiles = []  # per query block: its score tiles' key ranges
    for qa, qb in q_blocks:
        low, high = key_span(qa, qb)
        seen = [(a, b) for a, b in k_blocks if b > low and a <= high]
        tiles.append(chunks(seen, max(max_keys or block_k, block_k)))

    def tile_scores(q_i, k_j, qa, qb, ka, kb):
        # The GEMM returns the compute dtype, as in Attention.attend (the same rounding
        # of the scores); the softmax is float32 from there.
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
            if len(tiles[i]) == 1:  # the whole row at once: an exact softmax
                (ka, kb), = tiles[i]
                s, _ = tile_scores(q_i, k[:, ka:kb], qa, qb, ka, kb)
                m = tf.reduce_max(s, axis=-1, keepdims=True)  # (B, K, G, P, t, 1)
                p = tf.exp(s - m)
                l = tf.reduce_sum(p, axis=-1, keepdims=True)
                # normalized before P x V, as tf.nn.softmax in Attention.attend
                out_i = tf.cast(tf.einsum("bkgpts,bskd->bkgptd", tf.cast(p / l, v.dtype),
                                          v[:, ka:kb]), tf.float32)  # (B, K, G, P, t, D)
            else:  # an online softmax over the row's tiles
                m = l = acc = pv = None
                for ka, kb in tiles[i]:
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
                        alpha = tf.exp(m - m_new)  # rescales what the earlier tiles gave
                        l = l * alpha + tf.reduce_sum(p, axis=-1, keepdims=True)
                        acc = acc * alpha + tf.cast(pv, tf.float32)
                    m = m_new
                out_i = acc / l  # (B, K, G, P, t, D) float32
            outs.append(out_i)
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
            # float32 sums of the key and value gradients, per key block
            dk = [tf.zeros(k[:, a:b].shape, tf.float32) for a, b in k_blocks]
            dv = [tf.zeros(v[:, a:b].shape, tf.float32) for a, b in k_blocks]

            def add(sums, part, ka, kb):  # part (B, kb - ka, K, D) into the key blocks
                for j, (a, b) in enumerate(k_blocks):
                    if ka <= a and b <= kb:
                        sums[j] += tf.cast(part[:, a - ka:b - ka], tf.float32)

            for i, (qa, qb) in enumerate(q_blocks):
                q_i = qg[:, :, :, :, qa:qb]  # (B, K, G, P, t, D)
                do_i = after(dog[:, :, :, :, qa:qb], dq[-1][:, :, :, :, -1:] if dq else None)
                lse_i, delta_i = lse[:, :, :, :, qa:qb], delta[:, :, :, :, qa:qb]  # (B,K,G,P,t,1)
                dq_i, dq_ij = None, None
                for ka, kb in tiles[i]:
                    k_j, v_j = k[:, ka:kb], v[:, ka:kb]
                    # tile after tile, waiting on the last tile's GEMM output
                    previous = None if dq_ij is None else dq_ij[:, :, :, :, -1:]
                    q_ij, do_ij = after(q_i, previous), after(do_i, previous)
                    s, allowed = tile_scores(q_ij, k_j, qa, qb, ka, kb)
                    p = tf.exp(s - lse_i)  # the forward pass's probabilities, recomputed
                    if allowed is not None:
                        p = tf.where(allowed, p, 0.0)
                    add(dv, tf.einsum("bkgpts,bkgptd->bskd", tf.cast(p, v.dtype), do_ij),
                        ka, kb)
                    # dP in the compute dtype, as the standard path's gradient of P x V
                    dp = tf.cast(tf.einsum("bkgptd,bskd->bkgpts", do_ij, v_j), tf.float32)
                    if len(tiles[i]) == 1:
                        # a whole row: the softmax's correction term from the rounded dP,
                        # as the standard path's softmax gradient, so that dP's rounding
                        # (alike across a row whose dP cluster near delta) cancels; from
                        # O it did not, and gradients erred 2.1x the one-shot path's
                        delta_i = tf.reduce_sum(p * dp, -1, keepdims=True)
                    ds = tf.cast(p * (dp - delta_i) * scale, q.dtype)
                    dq_ij = tf.einsum("bkgpts,bskd->bkgptd", ds, k_j)  # (B, K, G, P, t, D)
                    dq_i = (tf.cast(dq_ij, tf.float32) if dq_i is None
                            else dq_i + tf.cast(dq_ij, tf.float32))
                    add(dk, tf.einsum("bkgpts,bkgptd->bskd", ds, q_ij), ka, kb)
                dq.append(tf.cast(dq_i, q.dtype))
            return (ungrouped(tf.concat(dq, axis=4)), tf.cast(tf.concat(dk, axis=1), k.dtype),
                    tf.cast(tf.concat(dv, axis=1), v.dtype))

        return out, grad

    return attend(q, k, v)
