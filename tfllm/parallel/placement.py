"""The bridge between Keras 3 variables and DTensor.

A model is first built under `keras.StatelessScope`, which gives every Keras variable
its path and shape but allocates nothing. `place_variables` then creates each variable
directly in its layout: on every local device it generates only that device's shard
(`tfllm.parallel.init`), packs the shards into a DTensor and wraps it in a
`dtensor.DVariable` that the Keras variable adopts. No weight is ever materialized
whole on one accelerator. Without a mesh (`parallel=None`) the same values go into
plain `tf.Variable`s: the single-device reference the parity tests compare against.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfllm.parallel import blocks, fsdp
from tfllm.parallel import rules as rules_lib
from tfllm.parallel.init import initial_block, variable_key
from tfllm.internals import adopt, check_keras, forget_deferred, is_allocated
from tfllm.parallel.mesh import mesh_shape


class Parallel:
    """A mesh, its rules table and the placement options: the whole sharding setup.

    Args:
      mesh: a `dtensor.Mesh`.
      rules: ordered (logical axis, mesh axis or None) pairs.
      shard_optimizer_state: ZeRO-1, optimizer states further sharded over "data".
      bucket_bytes: the largest replicated-gradient reduction (`tfllm.parallel.blocks`).
      attention_recomputed: the model recomputes its attention core (`model.remat`
        attention or selective); see `fsdp.configure_dtensor`.
    """

    def __init__(self, mesh, rules: rules_lib.Rules = rules_lib.DEFAULT_RULES,
                 shard_optimizer_state: bool = False,
                 bucket_bytes: int = blocks.DEFAULT_BUCKET_BYTES,
                 attention_recomputed: bool = False):
        self.mesh = mesh
        self.rules = tuple(rules)
        self.shape: Dict[str, int] = mesh_shape(mesh)
        self.shard_optimizer_state = shard_optimizer_state
        self.bucket_bytes = bucket_bytes
        self.device_type = mesh.device_type()
        self.attention_recomputed = attention_recomputed
        fsdp.configure_dtensor(self.shape, attention_recomputed)

    # ---- specs and layouts ---------------------------------------------------------------
    def spec(self, path: str, shape: Sequence[int], logical_axes) -> rules_lib.Spec:
        return rules_lib.resolve_spec(path, shape, logical_axes, self.rules, self.shape)

    def layout(self, spec: rules_lib.Spec) -> dtensor.Layout:
        return dtensor.Layout([m or dtensor.UNSHARDED for m in spec], self.mesh)

    def replicated(self, rank: int) -> dtensor.Layout:
        return dtensor.Layout.replicated(self.mesh, rank)

    def variable_spec(self, var) -> rules_lib.Spec:
        return self.spec(var.path, tuple(var.shape), var.logical_axes)

    def optimizer_spec(self, var) -> rules_lib.Spec:
        spec = self.variable_spec(var)
        if self.shard_optimizer_state:
            spec = rules_lib.zero1_spec(var.path, tuple(var.shape), spec, self.shape)
        return spec

    @property
    def batch_mesh_axes(self):
        """Mesh axes that the rules can split tokens over, by rows or by sequence (data
        and fsdp by default): weights sharded over them are gathered before use."""
        return rules_lib.activation_mesh_axes(self.rules)

    def expert_parallel(self, var) -> bool:
        """Whether `var` (a stacked expert kernel) has its experts split over a batch axis."""
        axes = getattr(var, "logical_axes", ())
        return "experts" in axes and self.variable_spec(var)[
            list(axes).index("experts")] in self.batch_mesh_axes

    def for_decoding(self) -> "Parallel":
        """This setup with the sequence never split: decoding feeds one token at a time
        and prompts of any length. Weights keep their layouts (the rules for weights are
        unchanged)."""
        if not any(l == "activation_length" and m is not None for l, m in self.rules):
            return self
        return Parallel(self.mesh, rules_lib.without_sequence_sharding(self.rules),
                        self.shard_optimizer_state, self.bucket_bytes,
                        self.attention_recomputed)

    def _weight_layouts(self, w, logical_axes, name):
        """(shard layout, compute layout) of a weight, or None when nothing is gathered:
        dimensions sharded over a batch axis (FSDP) are gathered for the computation."""
        spec = self.spec(name, list(w.shape), logical_axes)
        compute = rules_lib.compute_spec(spec, logical_axes, self.batch_mesh_axes)
        if compute == spec:
            return None
        return self.layout(spec), self.layout(compute)

    def gather_weight(self, w, logical_axes, name: str = "weight"):
        """`w` gathered over the batch axes (see `tfllm.parallel.fsdp.gather`)."""
        layouts = self._weight_layouts(w, logical_axes, name)
        return w if layouts is None else fsdp.gather(w, *layouts)

    def weight_product(self, fn, x, w, logical_axes, name: str = "weight", extra=(),
                       equation=None, einsum=None):
        """fn(x, w, *extra). Inside a block (`block_scope`) an einsum whose equation leads
        with batch and length runs per batch piece on the block's gathered weight
        (`tfllm.parallel.blocks`); else `w` is gathered just before use and again in the
        backward pass (see `tfllm.parallel.fsdp.gathered_product`)."""
        block = blocks.current()
        if block is not None and equation is not None:
            y = blocks.product(block, w, equation, einsum, x, extra)
            if y is not None:
                return y
        layouts = self._weight_layouts(w, logical_axes, name)
        if layouts is None:
            return fn(x, w, *extra)
        return fsdp.gathered_product(fn, x, w, *layouts, extra=extra)

    def apply_weight(self, op, x, w, logical_axes, name: str = "weight"):
        """op(x, w) for a weight broadcast over x's trailing dimensions (bias, norm)."""
        block = blocks.current()
        if block is not None:
            y = blocks.apply(block, op, x, w)
            if y is not None:
                return y
        return op(x, self.gather_weight(w, logical_axes, name))

    def pieces(self, shape) -> blocks.Pieces:
        """How an activation of `shape` (B, T, ...) splits its batch and length."""
        spec = self.spec("activation", list(shape[:2]) + [1],
                         ("activation_batch", "activation_length", "activation_embed"))
        return blocks.Pieces([(d, spec[d], self.shape[spec[d]]) for d in (0, 1)
                              if spec[d] and self.shape[spec[d]] > 1])

    def block(self, variables, x, compute_dtype, gate=(), regather=True, name="block"):
        """A `tfllm.parallel.blocks.Block` of these variables for input x, entered; None
        when the batch is not split (nothing to reduce per block)."""
        pieces = self.pieces(x.shape.as_list())
        # Expert-parallel kernels stay out of the block: nothing gathers them (each device
        # computes its own experts) and their gradient needs no reduction (each expert's
        # tokens all reach its device), while a block runs its products per batch piece
        # and reduces over the batch axes, the very axis the experts are split over.
        variables = [v for v in variables if not self.expert_parallel(v)]
        if not pieces.splits or not variables:
            return None
        previous = blocks.last() if regather else None
        if previous is not None and previous.graph is not x.graph:
            previous = None
        return blocks.Block(self, variables, pieces, compute_dtype, gate, previous, regather,
                            self.bucket_bytes, name).enter()

    def global_norm(self, tensors, variables):
        """sqrt(sum of squares) of tensors laid out like `variables`, in float32, with one
        scalar all-reduce per distinct set of sharded mesh axes (not one per tensor): each
        tensor is first summed on its device into a (mesh sizes) tensor (see
        `tfllm.parallel.blocks._Packing`), those are added, then reduced."""
        groups: Dict[tuple, list] = {}
        order = list(self.shape)
        for t, v in zip(tensors, variables):
            spec = self.variable_spec(v)
            axes = tuple(a for a in order if a in spec)
            sq = tf.square(tf.cast(t, tf.float32))
            if axes:
                packing = blocks._Packing(v.shape, spec, axes, self.shape)
                sq = tf.reduce_sum(packing.pack(sq), axis=-1)
            else:
                sq = tf.reduce_sum(sq)
            groups.setdefault(axes, []).append(sq)
        total = tf.add_n([tf.reduce_sum(tf.add_n(parts)) for parts in groups.values()])
        return tf.sqrt(total)

    def constrain(self, x, logical_axes, name: str = "activation"):
        spec = self.spec(name, x.shape.as_list(), logical_axes)
        return fsdp.relayout_16bit(x, self.layout(spec))

    # ---- shards ------------------------------------------------------------------------
    def local_blocks(self, shape: Sequence[int], spec: rules_lib.Spec):
        """(device, start, size) of this client's shards of a tensor laid out by spec."""
        return local_blocks(self.mesh, shape, spec)

    def make_sharded(self, spec: rules_lib.Spec, shape: Sequence[int], block_fn):
        """Packs a DTensor whose shard on each local device is block_fn(start, size)."""
        components = []
        for device, start, size in self.local_blocks(shape, spec):
            with tf.device(device):
                components.append(block_fn(start, size))
        return dtensor.pack(components, self.layout(spec))

    def shard_array(self, array: np.ndarray, spec: rules_lib.Spec):
        """A global numpy array as a DTensor laid out by `spec`; each local device receives
        only its slice (batches: `tfllm.data.feed.place`)."""
        def block(start, size):
            return tf.constant(array[block_slices(start, size)])
        return self.make_sharded(spec, array.shape, block)


def local_blocks(mesh, shape: Sequence[int], spec: rules_lib.Spec):
    """(device, start, size) of each local shard of a `shape` tensor laid out by `spec`
    (one mesh axis name or None per dimension) on `mesh`."""
    mesh_dims = {name: mesh.dim_size(name) for name in mesh.dim_names}
    size = rules_lib.shard_shape(shape, spec, mesh_dims)
    return [(device, [loc[m] * n if m else 0 for m, n in zip(spec, size)], size)
            for device, loc in zip(mesh.local_devices(), mesh.local_device_locations())]


def block_slices(start, size):
    """The numpy index of the block at `start` with `size` (one slice per dimension)."""
    return tuple(slice(s, s + n) for s, n in zip(start, size))


def to_numpy(x) -> np.ndarray:
    """A tensor or (possibly sharded) DTensor, gathered to one numpy array."""
    if isinstance(x, keras.Variable):
        x = x.value
    if isinstance(x, tf.Variable):
        x = x.read_value()
    if not dtensor.is_dtensor(x):
        return np.asarray(x)
    layout = dtensor.fetch_layout(x)
    spec = [None if s == dtensor.UNSHARDED else s for s in layout.sharding_specs]
    if all(s is None for s in spec):
        # Replicated (a step's metrics): every device holds the same value, so one
        # device-to-host copy, not one per local device (8 per metric per step on 8 GPUs).
        return dtensor.unpack(x)[0].numpy()
    out = np.zeros(x.shape.as_list(), dtype=x.dtype.as_numpy_dtype)
    blocks = local_blocks(layout.mesh, x.shape.as_list(), spec)
    for part, (_, start, size) in zip(dtensor.unpack(x), blocks):
        out[block_slices(start, size)] = part.numpy()
    return out


def build_abstract(model: keras.Model) -> keras.Model:
    """Builds `model` under a stateless scope: paths and shapes, no memory."""
    with keras.StatelessScope(initialize_variables=False):
        model.build(None)
    return model


def new_variable(parallel: Optional[Parallel], spec, shape, init, dtype, name: str,
                 key: int = 0, trainable: bool = False) -> tf.Variable:
    """A variable filled by `init`: a DVariable in layout `spec`, or a plain tf.Variable.

    Args:
      parallel: the sharding setup, or None for a single-device variable.
      spec: per-dimension mesh axes (ignored without `parallel`).
      shape, dtype, name: of the variable.
      init: ("normal", std), ("zeros",) or ("ones",).
      key: the random key for "normal" (see `tfllm.parallel.init.variable_key`).
      trainable: whether gradient tapes watch it.
    """
    shape = tuple(int(n) for n in shape)
    jit = parallel is not None and parallel.device_type != "CPU"
    block = lambda start, size: initial_block(init, shape, key, start, size, dtype, jit)
    if parallel is None:
        return tf.Variable(block([0] * len(shape), shape), trainable=trainable, name=name)
    value = parallel.make_sharded(spec, shape, block)
    return dtensor.DVariable(value, trainable=trainable, name=name)


def place_variables(model: keras.Model, parallel: Optional[Parallel], seed: int,
                    zeros: bool = False) -> None:
    """Creates every (deferred) variable of `model` in its layout, with mesh-independent values.

    Args:
      model: built with `build_abstract`; every variable carries `logical_axes` and `init`.
      parallel: the sharding setup, or None for plain single-device variables.
      seed: the init seed.
      zeros: fill with zeros instead of each variable's init (for weights about to be
        overwritten, e.g. a pretrained import: the random init's hashing needs several
        times a tensor's size in temporaries); variables marked `init_when_loading`
        (LoRA adapters, which no preset holds) still get their init.
    """
    check_keras()
    try:
        _place(model, parallel, seed, zeros)
    finally:
        # Placed or not (a refused variable stops the build), none of the model's
        # variables may stay in Keras' global list of variables awaiting deferred
        # initialization: the next model Keras builds would initialize them.
        forget_deferred(model.variables)


def _place(model, parallel, seed: int, zeros: bool) -> None:
    for var in model.variables:
        if is_allocated(var):
            raise ValueError(f"{var.path}: already initialized; build the model with "
                             "tfllm.models.build_model (or build_abstract) first.")
        if not hasattr(var, "init"):
            raise ValueError(f"{var.path}: created without tfllm.models.common.add_param, so "
                             "it has no logical axes; create weights with add_param.")
        spec = parallel.variable_spec(var) if parallel is not None else None
        # FP8 amax histories receive their new values as gradients (overwrite-with-
        # gradient), so TensorFlow must see them as differentiable: a recomputation
        # (remat) returns gradients only for the trainable variables its tape watched.
        # Keras still lists them as non-trainable, so the optimizer never touches them.
        differentiable = var.trainable or getattr(var, "kind", None) == "fp8_state"
        # A weight no pretrained preset holds (a LoRA adapter) gets its init even then.
        blank = zeros and not getattr(var, "init_when_loading", False)
        tf_var = new_variable(parallel, spec, tuple(var.shape),
                              ("zeros",) if blank else var.init, var.dtype, var.name,
                              key=variable_key(seed, var.path), trainable=differentiable)
        adopt(var, tf_var)
