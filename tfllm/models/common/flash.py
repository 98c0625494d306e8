"""Memory-efficient attention in plain TensorFlow ops: blocks of queries and keys, an
online softmax, and a backward pass that recomputes each block (FlashAttention's
algorithm, written for XLA and DTensor rather than as a kernel).

Neither pass keeps a (T, S) matrix: the forward pass keeps, per query, its output and the
log-sum-exp of its scores; the backward pass recomputes one tile of scores at a time from
them. A tile is a block of queries against the keys it may see (up to `max_keys`): one
GEMM and one softmax for a whole row of (block_q, block_k) units. Tiles run one after
another (each waits on the previous tile's GEMM outputs: under XLA on one device
through an optimization barrier, which moves no data; see `after`), so activation
memory is linear in the sequence; key blocks that the causal mask (or a sliding window) hides from a whole
query block are skipped in both passes.

Numerics: scores leave their GEMM in the compute dtype, as in `Attention.attend`; the
softmax, the running maximum, the normalizer, the accumulated output and the sums of
gradients across tiles are float32; P (exp(S - max), normalized after P x V) and dS are
cast to the compute dtype for their GEMMs. The backward pass takes the softmax's
correction term from the float32 output (FlashAttention-2's delta = rowsum(dO * O)) and
subtracts it inside the dP GEMM (dO and V carry two more columns; the forward's P x V
reads the same widened V, so that XLA copies each tile's values once), so dP - delta is
rounded to the compute dtype once, after the cancellation. No GEMM of either pass takes a
float32 operand under XLA.

Grouped queries read the (B, S, K, D) keys and values as they are, never repeated per
query head: queries, outputs and their gradients are held head-major (B, K, G, P, L, D).
What the passes cost on an H100 is measured by benchmarks/attention_bytes.py.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import tensorflow as tf

from tfllm import internals
from tfllm.parallel.context import current

_PAD = 8  # dO and V get 8 columns for delta (see grad)
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


def dot_accumulated(equation: str, a, b):
    """`tf.einsum(equation, a, b)` of compute-dtype operands, accumulated in float32 and
    rounded once to the compute dtype: under XLA one GEMM of the operands as they are
    (XLA accumulates bf16 products in float32); elsewhere the einsum of float32 casts,
    rounded after (TensorFlow's CPU kernels may sum bf16 products in bf16, which a sum
    that cancels, as dP - delta, cannot afford). The same numbers either way: products of
    bf16 values are exact in float32."""
    if a.dtype == tf.float32 or internals.in_xla_context():
        return tf.einsum(equation, a, b)
    return tf.cast(tf.einsum(equation, tf.cast(a, tf.float32), tf.cast(b, tf.float32)),
                   a.dtype)


def chunks(spans: List[Tuple[int, int]], max_keys: int) -> List[Tuple[int, int]]:
    """Key blocks `spans` (in order) joined into chunks of adjacent blocks of at most
    `max_keys` keys (at least one block each): the key ranges of a query block's tiles."""
    out = []
    for a, b in spans:
        if out and a == out[-1][1] and b - out[-1][0] <= max_keys:
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
    widest = max(max_keys or block_k, block_k)
    seen = []  # per query block: the key blocks it may see
    for qa, qb in q_blocks:
        low, high = key_span(qa, qb)
        seen.append([j for j, (a, b) in enumerate(k_blocks) if b > low and a <= high])
    # the forward pass's tiles: per query block, key ranges (its row of key blocks)
    tiles = [chunks([k_blocks[j] for j in js], widest) for js in seen]

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

    def after(x, previous, exact=True):
        """x, made to wait for `previous` (a tile's GEMM output or a list of them: (B, K,
        G, P, t, D) queries' or (B, s, K, D) keys'), so that the tiles run one after
        another instead of side by side with all their scores alive.

        Under XLA on one device: an optimization barrier of x and `previous` (no
        kernel, no bytes), which orders the GPU program; and, unless `exact` is False,
        x + 0 * y of one element of each query-side y (broadcast, exact), because XLA's
        CPU compiler removes barriers before it schedules (barriers alone: its
        temporaries grew 2.9x from 512 to 1024 tokens). Elsewhere, and on a DTensor
        mesh (its layout propagation has no rule for the barrier), x + 0 * y of every
        y (TensorFlow does not fold it). The sums cost a fusion per operand and tile, so
        they go only where the data does not already order the tile (`exact`): its
        score and dP GEMMs' operands; dV's GEMM waits through P
        (benchmarks/results/attention_bytes.md)."""
        if previous is None:
            return x
        previous = previous if isinstance(previous, list) else [previous]
        if internals.in_xla_context() and current() is None:
            x = internals.optimization_barrier(x, *previous)[0]
            previous = [y for y in previous if y.shape.rank == 6]  # the small ones
        if not exact:  # the data orders it already: no sum (a fusion reading x) anywhere
            return x
        for y in previous:
            y = key_row(y) if y.shape.rank == 4 else y[:, :, :, :, -1:]
            x = x + tf.cast(0.0, x.dtype) * tf.cast(y[..., :1], x.dtype)
        return x

    def key_row(part):  # (B, s, K, D) -> its last key's row (B, K, 1, 1, 1, D), for after
        row = tf.transpose(part[:, -1:], (0, 2, 1, 3))  # (B, K, 1, D)
        return tf.expand_dims(tf.expand_dims(row, 2), 2)

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

    widths = [[0, 0]] * 5 + [[0, _PAD - 2]]  # zero columns after the two (see grad)

    @tf.custom_gradient
    def attend(q, k, v):
        qg = grouped(q)  # (B, K, G, P, L, D)
        # V with the backward's two columns of -1 (and zeros to D + 8), in both passes:
        # P x V takes it too (and drops the 8 columns it gives), so that XLA lays out each
        # tile's values once for P x V and the backward's dP - delta GEMM, as it does the
        # keys for the scores and dQ, instead of a second copy per tile in the backward
        minus = -tf.ones_like(v[:, :, :, :1])  # (B, S, K, 1)
        v_delta = tf.pad(tf.concat([v, minus, minus], -1), widths[2:])  # (B, S, K, D+8)
        outs, lses, last = [], [], None
        for i, (qa, qb) in enumerate(q_blocks):
            q_i = after(qg[:, :, :, :, qa:qb], last)  # (B, K, G, P, t, D)
            if len(tiles[i]) == 1:  # the whole row at once: an exact softmax
                (ka, kb), = tiles[i]
                s, _ = tile_scores(q_i, k[:, ka:kb], qa, qb, ka, kb)
                m = tf.reduce_max(s, axis=-1, keepdims=True)  # (B, K, G, P, t, 1)
                p = tf.exp(s - m)
                l = tf.reduce_sum(p, axis=-1, keepdims=True)
                # P x V takes exp(S - m) and the output is divided by the row sum after
                # (as between tiles below), not P / l as tf.nn.softmax: XLA then sums P
                # in the pass that writes it, where P / l needs the sum first, one more
                # pass over the row's scores (benchmarks/results/attention_bytes.md)
                pv = tf.einsum("bkgpts,bskd->bkgptd", tf.cast(p, v.dtype),
                               v_delta[:, ka:kb])  # (B, K, G, P, t, D + 8)
                out_i = tf.cast(pv[..., :dim], tf.float32) / l  # (B, K, G, P, t, D)
            else:  # an online softmax over the row's tiles
                m = l = acc = pv = None
                for ka, kb in tiles[i]:
                    # tile after tile, too: else XLA computes all of a block's scores first
                    # (waiting on the last tile's GEMM output, which a fusion reads directly)
                    q_ij = q_i if pv is None else after(q_i, pv)
                    s, _ = tile_scores(q_ij, k[:, ka:kb], qa, qb, ka, kb)
                    m_new = tf.reduce_max(s, axis=-1, keepdims=True)  # (B, K, G, P, t, 1)
                    if m is not None:
                        m_new = tf.maximum(m, m_new)
                    p = tf.exp(s - m_new)  # float32
                    pv = tf.einsum("bkgpts,bskd->bkgptd", tf.cast(p, v.dtype),
                                   v_delta[:, ka:kb])  # (B, K, G, P, t, D + 8)
                    if m is None:
                        l = tf.reduce_sum(p, axis=-1, keepdims=True)
                        acc = tf.cast(pv[..., :dim], tf.float32)
                    else:
                        alpha = tf.exp(m - m_new)  # rescales what the earlier tiles gave
                        l = l * alpha + tf.reduce_sum(p, axis=-1, keepdims=True)
                        acc = acc * alpha + tf.cast(pv[..., :dim], tf.float32)
                    m = m_new
                out_i = acc / l  # (B, K, G, P, t, D) float32
            outs.append(out_i)
            lses.append(m + tf.math.log(l))  # (B, K, G, P, t, 1)
            last = pv  # the row's last P x V (a GEMM's output, not the divided one)
        out32 = tf.concat(outs, axis=4)  # (B, K, G, P, L, D)
        out = ungrouped(tf.cast(out32, q.dtype))
        lse = tf.concat(lses, axis=4)  # (B, K, G, P, L, 1)

        def grad(d_out):
            dog = grouped(tf.cast(d_out, q.dtype))  # (B, K, G, P, L, D)
            # the softmax's correction term, per query: sum_d dO * O (B, K, G, P, L, 1),
            # from the float32 output (FlashAttention-2's delta)
            delta = tf.reduce_sum(tf.cast(dog, tf.float32) * out32, -1, keepdims=True)
            # dP - delta in one GEMM, so that it is rounded to the compute dtype after the
            # cancellation, not before (a bf16 dP less a float32 delta erred up to 1.96x
            # the one-shot path's gradients; a float32 dP doubles its bytes): dO gets
            # columns delta_hi, delta_lo (delta ~ hi + lo to 16 bits) and V columns -1, -1,
            # both padded to D + 8 with zeros (tensor-core GEMMs take multiples of 8)
            hi = tf.cast(delta, q.dtype)
            lo = tf.cast(delta - tf.cast(hi, tf.float32), q.dtype)
            dog_delta = tf.pad(tf.concat([dog, hi, lo], -1), widths)  # (B, K, G, P, L, D+8)

            dq = []
            # float32 sums of the key and value gradients, per key block
            dk = [tf.zeros(k[:, a:b].shape, tf.float32) for a, b in k_blocks]
            dv = [tf.zeros(v[:, a:b].shape, tf.float32) for a, b in k_blocks]

            def add(sums, part, ka, kb):  # part (B, kb - ka, K, D) into the key blocks
                for j, (a, b) in enumerate(k_blocks):
                    if ka <= a and b <= kb:
                        sums[j] += tf.cast(part[:, a - ka:b - ka], tf.float32)

            done = None  # the last tile's GEMM outputs, which the next tile waits for
            for i, (qa, qb) in enumerate(q_blocks):
                q_i, lse_i = qg[:, :, :, :, qa:qb], lse[:, :, :, :, qa:qb]
                do_i, dod_i = dog[:, :, :, :, qa:qb], dog_delta[:, :, :, :, qa:qb]
                dq_i = None
                for ka, kb in tiles[i]:
                    # the next tile (of this row or the next) starts when this one's GEMMs
                    # are done: else XLA may compute several rows' scores side by side
                    # (the backward's score GEMMs need only q, k and lse) and activation
                    # memory grows as the square of the sequence
                    # (dO's GEMM, dV, also needs P, which waits through q)
                    q_ij, dod_ij = after(q_i, done), after(dod_i, done)
                    do_ij = after(do_i, done, exact=False)
                    k_j = k[:, ka:kb]  # (B, s, K, D)
                    s, allowed = tile_scores(q_ij, k_j, qa, qb, ka, kb)
                    p = tf.exp(s - lse_i)  # the forward pass's probabilities, recomputed
                    if allowed is not None:
                        p = tf.where(allowed, p, 0.0)
                    dv_ij = tf.einsum("bkgpts,bkgptd->bskd", tf.cast(p, v.dtype), do_ij)
                    dp_delta = dot_accumulated("bkgptd,bskd->bkgpts", dod_ij,
                                               v_delta[:, ka:kb])  # (B, K, G, P, t, s)
                    ds = tf.cast(p * tf.cast(dp_delta, tf.float32) * scale, q.dtype)
                    dq_ij = tf.einsum("bkgpts,bskd->bkgptd", ds, k_j)  # (B, K, G, P, t, D)
                    dk_ij = tf.einsum("bkgpts,bkgptd->bskd", ds, q_ij)  # (B, s, K, D)
                    dq_i = (tf.cast(dq_ij, tf.float32) if dq_i is None
                            else dq_i + tf.cast(dq_ij, tf.float32))
                    add(dv, dv_ij, ka, kb)
                    add(dk, dk_ij, ka, kb)
                    done = [dq_ij, dk_ij, dv_ij]
                dq.append(tf.cast(dq_i, q.dtype))
            return (ungrouped(tf.concat(dq, axis=4)), tf.cast(tf.concat(dk, axis=1), k.dtype),
                    tf.cast(tf.concat(dv, axis=1), v.dtype))

        return out, grad

    return attend(q, k, v)
