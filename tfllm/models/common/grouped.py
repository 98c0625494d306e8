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


def _tiles(t, tile: int):
    """(B, P, C) -> (B, P / tile, tile, C): the tiles as one axis, so that a loop reads
    tile j with a gather of one index (XLA: a dynamic slice; a dynamic `tf.slice` of the
    flat rows made tf2xla pad the whole operand to twice its size in every dimension)."""
    return tf.reshape(t, [-1, t.shape[1] // tile, tile, t.shape[-1]])


def _over_tiles(fn, tiled):
    """fn(j, tile j) -> (B, tile, O) for every tile of `tiled` (B, J, tile, C), stacked
    back as (B, J * tile, O)."""
    tiles, tile = tiled.shape[1], tiled.shape[2]

    def body(j, out):
        return j + 1, out.write(j, fn(j, tf.gather(tiled, j, axis=1)))

    out = tf.TensorArray(tiled.dtype, size=tiles)
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
    if tiles * tile != x.shape[1] or tile_expert.shape[1] != tiles:
        raise ValueError(f"grouped_matmul: {x.shape[1]} rows are not the {tile_expert.shape[1]}"
                         f" tiles of {tile} rows that tile_expert names; plan with "
                         "dispatch.plan_grouped.")

    def expert_of(j):  # (B,) the expert of tile j of each row
        return tf.gather(tile_expert, j, axis=1)

    @tf.custom_gradient
    def product(x, k):
        x_tiles = _tiles(x, tile)  # (B, J, tile, I)
        y = _over_tiles(lambda j, xt: tf.einsum("bni,bio->bno", xt,
                                                tf.gather(k, expert_of(j))), x_tiles)

        def grad(dy):
            dy_tiles = _tiles(dy, tile)  # (B, J, tile, O)
            dx = _over_tiles(lambda j, dyt: tf.einsum("bno,bio->bni", dyt,
                                                      tf.gather(k, expert_of(j))), dy_tiles)

            def accumulate(j, dk):
                piece = tf.einsum("bni,bno->bio", tf.gather(x_tiles, j, axis=1),
                                  tf.gather(dy_tiles, j, axis=1))  # (B, I, O)
                return j + 1, tf.tensor_scatter_nd_add(dk, expert_of(j)[:, None], piece)

            _, dk = tf.while_loop(lambda j, _: j < tiles, accumulate,
                                  (tf.constant(0), tf.zeros_like(k)))
            return dx, dk

        return y, grad

    return product(x, tf.convert_to_tensor(kernel))
