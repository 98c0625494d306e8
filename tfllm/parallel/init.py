"""Initial values that are the same on every mesh.

DTensor's sharded random ops give different values than the unsharded op with the same
seed, so a model's init would depend on its mesh. tfllm instead derives each element
from a counter-based hash of (seed, variable path, global element index): any shard
of a tensor can be generated on its own device, from its global offsets, and the
assembled tensor is bit-identical whatever the layout.

Normal values use Box-Muller on two 24-bit uniforms from murmur3's 32-bit finalizer.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Sequence, Tuple

import tensorflow as tf


def variable_key(seed: int, path: str) -> int:
    """A 32-bit key for a variable: stable across processes, meshes and Python runs."""
    return zlib.crc32(f"{int(seed)}:{path}".encode("utf-8")) & 0xFFFFFFFF


def _u32(value: int):
    return tf.constant(value & 0xFFFFFFFF, tf.uint32)


def _fmix(h):
    """murmur3's 32-bit finalizer: a bijective avalanche mix of uint32 values."""
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, _u32(16)))
    h = h * _u32(0x85EBCA6B)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, _u32(13)))
    h = h * _u32(0xC2B2AE35)
    return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, _u32(16)))


def _hash(lo, hi, key):
    """`key`: a uint32 scalar tensor."""
    return _fmix(tf.bitwise.bitwise_xor(lo, _fmix(tf.bitwise.bitwise_xor(hi, key))))


def _flat_index(global_shape: Sequence[int], start, size: Sequence[int]):
    """Global row-major index (int64) of each element of the block [start, start+size)."""
    index = tf.zeros(size, tf.int64)
    stride = 1
    for dim in reversed(range(len(size))):
        ids = tf.range(size[dim], dtype=tf.int64) + tf.cast(start[dim], tf.int64)
        shape = [1] * len(size)
        shape[dim] = size[dim]
        index = index + tf.reshape(ids, shape) * stride
        stride *= int(global_shape[dim])
    return index


@functools.lru_cache(maxsize=None)
def _block_fn(kind: str, global_shape: Tuple[int, ...], size: Tuple[int, ...], dtype: str,
              jit: bool):
    """The generator of one block shape. The variable's key and std are arguments, not
    constants: on GPU each generator is an XLA program compiled per device, and a
    program per variable (llama-7b: ~300 variables x 8 GPUs) was a compile storm at
    start-up; every layer's same-shaped weights now share one."""
    def fn(start, key, std):
        if kind == "zeros":
            return tf.zeros(size, dtype)
        if kind == "ones":
            return tf.ones(size, dtype)
        index = _flat_index(global_shape, start, size)
        lo = tf.cast(tf.bitwise.bitwise_and(index, 0xFFFFFFFF), tf.uint32)
        hi = tf.cast(tf.bitwise.right_shift(index, 32), tf.uint32)
        h1 = _hash(lo, hi, key)
        h2 = _hash(lo, hi, tf.bitwise.bitwise_xor(key, _u32(0x9E3779B9)))
        scale = 1.0 / (1 << 24)
        # u1 in (0, 1] so that log(u1) is finite; u2 in [0, 1).
        u1 = (tf.cast(tf.bitwise.right_shift(h1, _u32(8)), tf.float32) + 1.0) * scale
        u2 = tf.cast(tf.bitwise.right_shift(h2, _u32(8)), tf.float32) * scale
        normal = tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(2.0 * math.pi * u2)
        return tf.cast(normal * std, dtype)

    return tf.function(fn, jit_compile=True) if jit else fn


def initial_block(init: Tuple, global_shape: Sequence[int], key: int, start: Sequence[int],
                  size: Sequence[int], dtype: str = "float32", jit: bool = False):
    """The block [start, start + size) of a tensor initialized by `init`.

    Args:
      init: ("normal", std), ("zeros",) or ("ones",).
      global_shape: the whole tensor's shape.
      key: `variable_key(seed, path)`.
      start: the block's offset in each dimension.
      size: the block's shape.
      dtype: the result's dtype.
      jit: generate with XLA (use on GPU, where eager uint32 kernels are missing).
    """
    std = float(init[1]) if init[0] == "normal" else 0.0
    fn = _block_fn(init[0], tuple(int(s) for s in global_shape), tuple(int(s) for s in size),
                   str(dtype), bool(jit))
    return fn(tf.constant(list(start) or [0], tf.int64), _u32(int(key)),
              tf.constant(std, tf.float32))


def generator_count() -> int:
    """Block generators made so far in this process: one per kind, block shape, dtype and
    jit setting (on GPU, each is one XLA program per device)."""
    return _block_fn.cache_info().currsize
