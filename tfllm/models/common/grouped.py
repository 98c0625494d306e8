"""A grouped matmul in TensorFlow: each tile of rows times its own expert's kernel.

TensorFlow has no ragged grouped matmul (JAX's `ragged_dot`, torch's `grouped_mm`). This
is one with static shapes over MegaBlocks' layout (`dispatch.plan_grouped`: each expert's
tokens padded to whole tiles, so that every tile belongs to one expert): a loop over the
tiles multiplies each by its expert's kernel (a dynamic slice, one per row of the batch),
so the FLOPs are the tokens' own plus the tiles' padding.

`grouped_matmul`'s backward pass is written by hand, as loops of the same shape: the
input gradient tile by tile, and the kernel gradient accumulated into one (E, I, O)
buffer (a scatter-add into a loop-carried tensor, which XLA updates in place), so that
neither direction keeps one kernel slice per tile.

Expert parallelism does not fit this layout (a tile reads its expert's kernel wherever
it lives); it uses the (B, E, C, D) slots of `dispatch.plan_slots`, where the relayout
from rows to experts is the all-to-all.
"""

from __future__ import annotations

import tensorflow as tf


def _tile(t, j, tile: int):
    """Rows j*tile .. (j+1)*tile of (B, P, ...) `t`; a dynamic slice of static size."""
    begin = tf.stack([0, j * tile] + [0] * (t.shape.rank - 2))
    return tf.slice(t, begin, [-1, tile] + [-1] * (t.shape.rank - 2))


def _over_tiles(fn, tiles: int, tile: int, x):
    """fn(j, tile j of x) -> (B, tile, O) for every tile, stacked back as (B, P, O)."""
    def body(j, out):
        return j + 1, out.write(j, fn(j, _tile(x, j, tile)))

    out = tf.TensorArray(x.dtype, size=tiles)
    _, out = tf.while_loop(lambda j, _: j < tiles, body, (tf.constant(0), out))
    stacked = out.stack()  # (J, B, tile, O)
    return tf.reshape(tf.transpose(stacked, [1, 0, 2, 3]),
                      [-1, tiles * tile, stacked.shape[-1]])


def grouped_matmul(x, kernel, tile_expert, tile: int):
    """Tile j of row b of x times its expert's kernel, kernel[tile_expert[b, j]].

    Args:
      x: (B, P, I), P a multiple of `tile`.
      kernel: (E, I, O).
      tile_expert: (B, P / tile) int32.
      tile: rows per tile.

    Returns:
      (B, P, O).
    """
    tiles = x.shape[1] // tile

    def expert_of(j):  # (B,) the expert of tile j of each row
        return tf.gather(tile_expert, j, axis=1)

    @tf.custom_gradient
    def product(x, k):
        y = _over_tiles(lambda j, xt: tf.einsum("bni,bio->bno", xt,
                                                tf.gather(k, expert_of(j))), tiles, tile, x)

        def grad(dy):
            dx = _over_tiles(lambda j, dyt: tf.einsum("bno,bio->bni", dyt,
                                                      tf.gather(k, expert_of(j))),
                             tiles, tile, dy)

            def accumulate(j, dk):
                piece = tf.einsum("bni,bno->bio", _tile(x, j, tile), _tile(dy, j, tile))
                return j + 1, tf.tensor_scatter_nd_add(dk, expert_of(j)[:, None], piece)

            _, dk = tf.while_loop(lambda j, _: j < tiles, accumulate,
                                  (tf.constant(0), tf.zeros_like(k)))
            return dx, dk

        return y, grad

    return product(x, tf.convert_to_tensor(kernel))
